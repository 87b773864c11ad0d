// Raw-pointer launcher of the rope + KV-cache-write kernel (rope_cache_cuda.cuh; declared in fused_launch.h).
// Torch-free.
#include <cstdint>

#include "ops/fused/fused_launch.h"
#include "ops/fused/rope_cache_cuda.cuh"

namespace pagellm::cuda {

namespace {
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T, typename C>
cudaError_t rope_cache_typed(const RotaryArgs& r, const ReshapeAndCacheArgs& w, cudaStream_t s) {
  constexpr int kVec = VecTraits<T>::kElems;
  const bool vec_value = w.head_dim % kVec == 0 && w.value_tok_stride % kVec == 0 && w.value_head_stride % kVec == 0 &&
                         aligned16(w.value) && aligned16(w.value_cache);
  const int work = (r.num_q_heads + r.num_k_heads) * (r.rot_dim / 2);
  const int threads = work >= 512 ? 512 : (work >= 256 ? 256 : 128);
  const size_t smem = static_cast<size_t>(r.rot_dim) * sizeof(float);
  const unsigned grid = static_cast<unsigned>(r.num_tokens);
  if (vec_value)
    rotary_cache_kernel<T, C, true><<<grid, threads, smem, s>>>(r, w);
  else
    rotary_cache_kernel<T, C, false><<<grid, threads, smem, s>>>(r, w);
  return cudaGetLastError();
}

template <typename T>
cudaError_t rope_cache_cos(const RotaryArgs& r, const ReshapeAndCacheArgs& w, DType cos_sin_dtype, cudaStream_t s) {
  switch (cos_sin_dtype) {
    case DType::kFloat32: return rope_cache_typed<T, float>(r, w, s);
    case DType::kFloat16: return rope_cache_typed<T, __half>(r, w, s);
    case DType::kBFloat16: return rope_cache_typed<T, __nv_bfloat16>(r, w, s);
  }
  return cudaErrorInvalidValue;
}
}  // namespace

cudaError_t launch_rotary_embedding_and_cache(const RotaryArgs& r, const ReshapeAndCacheArgs& w, DType dtype,
                                              DType cos_sin_dtype, cudaStream_t stream) {
  if (r.num_tokens == 0) return cudaSuccess;
  if (r.num_tokens != w.num_tokens || r.num_tokens > 0x7fffffffLL || r.num_k_heads != w.num_kv_heads ||
      r.head_size != w.head_dim || r.rot_dim <= 0 || r.rot_dim % 2 != 0 || r.rot_dim > r.head_size)
    return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32: return rope_cache_cos<float>(r, w, cos_sin_dtype, stream);
    case DType::kFloat16: return rope_cache_cos<__half>(r, w, cos_sin_dtype, stream);
    case DType::kBFloat16: return rope_cache_cos<__nv_bfloat16>(r, w, cos_sin_dtype, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagellm::cuda
