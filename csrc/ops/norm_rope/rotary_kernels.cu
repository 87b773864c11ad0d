// Raw-pointer launcher of the rotary-embedding kernel (declared in norm_launch.h). Torch-free.
#include "ops/norm_rope/norm_launch.h"
#include "ops/norm_rope/rotary_cuda.cuh"

namespace pagellm::cuda {

namespace {
template <typename T, typename C>
cudaError_t rope_typed(const RotaryArgs& a, cudaStream_t s) {
  const int work = (a.num_q_heads + a.num_k_heads) * (a.rot_dim / 2);
  const int threads = work >= 512 ? 512 : (work >= 256 ? 256 : 128);
  const size_t smem = static_cast<size_t>(a.rot_dim) * sizeof(float);
  rotary_embedding_kernel<T, C><<<static_cast<unsigned>(a.num_tokens), threads, smem, s>>>(
      a.positions, static_cast<T*>(a.query), static_cast<T*>(a.key), static_cast<const C*>(a.cos_sin_cache),
      a.query_stride, a.query_head_stride, a.key_stride, a.key_head_stride, a.cache_stride, a.num_q_heads,
      a.num_k_heads, a.rot_dim, a.max_position, a.is_neox);
  return cudaGetLastError();
}

template <typename T>
cudaError_t rope_cache(const RotaryArgs& a, DType cache_dtype, cudaStream_t s) {
  switch (cache_dtype) {
    case DType::kFloat32: return rope_typed<T, float>(a, s);
    case DType::kFloat16: return rope_typed<T, __half>(a, s);
    case DType::kBFloat16: return rope_typed<T, __nv_bfloat16>(a, s);
  }
  return cudaErrorInvalidValue;
}
}  // namespace

cudaError_t launch_rotary_embedding(const RotaryArgs& a, DType dtype, DType cache_dtype, cudaStream_t stream) {
  if (a.num_tokens == 0 || a.rot_dim == 0 || a.num_q_heads + a.num_k_heads == 0) return cudaSuccess;
  if (a.rot_dim % 2 != 0 || a.rot_dim > a.head_size || a.num_tokens > 0x7fffffffLL) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32: return rope_cache<float>(a, cache_dtype, stream);
    case DType::kFloat16: return rope_cache<__half>(a, cache_dtype, stream);
    case DType::kBFloat16: return rope_cache<__nv_bfloat16>(a, cache_dtype, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
