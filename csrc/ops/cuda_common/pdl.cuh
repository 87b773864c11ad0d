// Programmatic dependent launch (PDL, sm_90+), torch-free. A kernel launched with the
// cudaLaunchAttributeProgrammaticStreamSerialization attribute may start while the kernel before it in the stream
// still runs, once every CTA of that one has called pdl_launch_dependents() (or exited): it can fetch what does not
// depend on its predecessor (a linear's weights) and must call pdl_wait() before it reads or writes anything the
// predecessor touches; pdl_wait() returns when the predecessor has completed and its writes are visible.
// Both are no-ops below sm_90 and in kernels launched without the attribute, so any kernel may call them.
#pragma once
#include <cuda_runtime.h>

namespace pagellm::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Called early by the kernels that precede a linear in a decode step (norms, activations, attention): it only
// lets the next kernel start its own prologue; the order of memory effects is kept by that kernel's pdl_wait().
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace pagellm::cuda
