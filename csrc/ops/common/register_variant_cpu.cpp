// Compiled into each CPU kernel library (one per instruction set, see cmake/extension.cmake): records
// which one was loaded, so pagellm._C.cpu_kernels_isa() and cpu_has_amx_bf16() can answer.
#include "ops/common/cpu_kernel_registry.h"
#include "ops/linear/amx_support.h"

#ifndef PAGELLM_CPU_ISA_NAME
#error "PAGELLM_CPU_ISA_NAME (the library's instruction set) is set by the build"
#endif

namespace {

const bool kRegistered = [] {
  pagellm::cpu::register_cpu_kernel_library({PAGELLM_CPU_ISA_NAME, &pagellm::cpu::amx::amx_bf16_usable});
  return true;
}();

}  // namespace
