// Which CPU kernel library this process loaded. The kernels are built once per instruction set
// (_C_cpu_avx2.so, _C_cpu_avx512.so); pagellm.cpu_isa loads one after pagellm._C, and its static
// initializer (register_variant_cpu.cpp) records itself here, in the small library both link
// (_C_cpu_common.so, which also holds the one thread pool), so _C can report what runs.
#pragma once

namespace pagellm::cpu {

struct CpuKernelLibrary {
  const char* isa = nullptr;                // "avx2", "avx512": the instruction set it was compiled for
  bool (*amx_bf16_usable)() = nullptr;      // whether its linear_amx can run on this machine
};

// Records the library that was just loaded. Called from a static initializer, so it never throws; a second
// library would re-register the same torch ops over the first one's, and it is then the one recorded
// (pagellm.cpu_isa loads one per process).
void register_cpu_kernel_library(const CpuKernelLibrary& library) noexcept;

// The loaded library, or nullptr when none is.
const CpuKernelLibrary* loaded_cpu_kernel_library();

}  // namespace pagellm::cpu
