// What this x86-64 CPU can run, from CPUID and the OS's XSAVE state (XCR0): a feature counts only when the
// CPU has it AND the OS saves its registers (an AVX-512 CPU under an OS or hypervisor that does not enable
// the opmask / ZMM state cannot run AVX-512 code). Torch-free; pagellm.cpu_isa picks the kernel library.
#pragma once

#include <string>
#include <vector>

namespace pagellm::cpu {

// The usable features, named as in /proc/cpuinfo: "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "lzcnt",
// "movbe", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16",
// "amx_tile", "amx_bf16" (AMX also needs a per-process Linux permission, asked for by the AMX kernels).
std::vector<std::string> cpu_features();

}  // namespace pagellm::cpu
