// Raw-pointer launcher of the paged-attention decode kernels over quantized (int8 / fp8-e4m3) caches, declared in
// attention_launch.h; its own translation unit so these instantiations compile next to the float ones. Torch-free.
#include <cstdint>

#include "ops/paged_attention/attention_launch.h"
#include "ops/paged_attention/decode_cuda.cuh"

namespace pagellm::cuda {

namespace {
template <typename T>
cudaError_t decode_cache(const DecodeArgs& a, KvCacheDType cache_dtype, cudaStream_t s) {
  switch (cache_dtype) {
    case KvCacheDType::kInt8: return decode_dispatch<T, int8_t>(a, s);
    case KvCacheDType::kFp8E4M3: return decode_dispatch<T, __nv_fp8_e4m3>(a, s);
  }
  return cudaErrorInvalidValue;
}
}  // namespace

cudaError_t launch_paged_attention_decode_quantized(const DecodeArgs& a, DType dtype, KvCacheDType cache_dtype,
                                                    cudaStream_t stream) {
  if (a.num_seqs == 0 || a.num_heads == 0) return cudaSuccess;
  if (const cudaError_t err = check_decode_launch(a); err != cudaSuccess) return err;
  if (a.k_scale == nullptr || a.v_scale == nullptr) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32: return decode_cache<float>(a, cache_dtype, stream);
    case DType::kFloat16: return decode_cache<__half>(a, cache_dtype, stream);
    case DType::kBFloat16: return decode_cache<__nv_bfloat16>(a, cache_dtype, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
