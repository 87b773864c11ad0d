// Raw-pointer launcher of the paged-attention prefill kernels over quantized (int8 / fp8-e4m3) caches, declared in
// attention_launch.h; its own translation unit so these instantiations compile next to the float ones. Torch-free.
#include <cstdint>

#include "ops/paged_attention/attention_launch.h"
#include "ops/paged_attention/prefill_cuda.cuh"

namespace pagellm::cuda {

cudaError_t launch_paged_attention_prefill_quantized(const PrefillArgs& a, DType dtype, KvCacheDType cache_dtype,
                                                     cudaStream_t stream) {
  if (a.num_tokens == 0 || a.num_heads == 0 || a.num_seqs == 0) return cudaSuccess;
  if (const cudaError_t err = check_prefill_launch(a, dtype); err != cudaSuccess) return err;
  if (a.k_scale == nullptr || a.v_scale == nullptr) return cudaErrorInvalidValue;
  switch (cache_dtype) {
    case KvCacheDType::kInt8: return prefill_head_dim<int8_t>(a, dtype, stream);
    case KvCacheDType::kFp8E4M3: return prefill_head_dim<__nv_fp8_e4m3>(a, dtype, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
