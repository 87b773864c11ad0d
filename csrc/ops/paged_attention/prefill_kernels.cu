// Raw-pointer launcher of the paged-attention prefill kernels over float caches (declared in attention_launch.h;
// the kernels and their per-instantiation launches are in prefill_cuda.cuh). Torch-free.
#include <cstdint>

#include "ops/paged_attention/attention_launch.h"
#include "ops/paged_attention/prefill_cuda.cuh"

namespace pagellm::cuda {

cudaError_t launch_paged_attention_prefill(const PrefillArgs& a, DType dtype, cudaStream_t stream) {
  if (a.num_tokens == 0 || a.num_heads == 0 || a.num_seqs == 0) return cudaSuccess;
  if (const cudaError_t err = check_prefill_launch(a, dtype); err != cudaSuccess) return err;
  return prefill_head_dim(a, dtype, stream);
}

}  // namespace pagellm::cuda
