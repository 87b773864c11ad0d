// Raw-pointer launchers for the paged KV-cache kernels (declared in cache_launch.h). Torch-free.
#include <cstdint>

#include "ops/cache_ops/cache_cuda.cuh"
#include "ops/cache_ops/cache_launch.h"

namespace pagellm::cuda {

namespace {
bool aligned(const void* p, int64_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

template <typename U>
cudaError_t rc_typed(const ReshapeAndCacheArgs& a, cudaStream_t s) {
  constexpr int64_t k = static_cast<int64_t>(sizeof(U));
  const int64_t per_unit = k / a.elem_size;  // elements per copy unit
  const int units_per_row = static_cast<int>(a.head_dim / per_unit);
  const int total = a.num_kv_heads * units_per_row;
  const int threads = total >= 512 ? 512 : (total >= 256 ? 256 : 128);
  reshape_and_cache_kernel<U><<<static_cast<unsigned>(a.num_tokens), threads, 0, s>>>(
      static_cast<U*>(a.key_cache), static_cast<U*>(a.value_cache), static_cast<const U*>(a.key),
      static_cast<const U*>(a.value), a.slot_mapping, a.key_tok_stride / per_unit, a.key_head_stride / per_unit,
      a.value_tok_stride / per_unit, a.value_head_stride / per_unit, a.num_kv_heads, units_per_row, a.block_size,
      a.num_blocks * a.block_size);
  return cudaGetLastError();
}
}  // namespace

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0 || a.num_kv_heads == 0 || a.head_dim == 0) return cudaSuccess;
  if (a.num_tokens > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  if (a.elem_size != 2 && a.elem_size != 4) return cudaErrorInvalidValue;
  const int64_t vec = 16 / a.elem_size;  // elements per 16-byte unit
  const bool vec_ok = a.head_dim % vec == 0 && a.key_tok_stride % vec == 0 && a.key_head_stride % vec == 0 &&
                      a.value_tok_stride % vec == 0 && a.value_head_stride % vec == 0 && aligned(a.key, 16) &&
                      aligned(a.value, 16) && aligned(a.key_cache, 16) && aligned(a.value_cache, 16);
  if (vec_ok) return rc_typed<int4>(a, stream);
  if (a.elem_size == 2) return rc_typed<uint16_t>(a, stream);
  return rc_typed<uint32_t>(a, stream);
}

namespace {
template <typename T, typename C>
cudaError_t rcq_typed(const ReshapeAndCacheArgs& a, cudaStream_t s) {
  const int rows = 2 * a.num_kv_heads;  // one warp per row, up to 8 warps
  const int threads = rows >= 8 ? 256 : 32 * rows;
  reshape_and_cache_quantized_kernel<T, C><<<static_cast<unsigned>(a.num_tokens), threads, 0, s>>>(
      static_cast<C*>(a.key_cache), static_cast<C*>(a.value_cache), a.k_scale, a.v_scale, static_cast<const T*>(a.key),
      static_cast<const T*>(a.value), a.slot_mapping, a.key_tok_stride, a.key_head_stride, a.value_tok_stride,
      a.value_head_stride, a.num_kv_heads, a.head_dim, a.block_size, a.num_blocks * a.block_size);
  return cudaGetLastError();
}

template <typename T>
cudaError_t rcq_cache(const ReshapeAndCacheArgs& a, KvCacheDType cache_dtype, cudaStream_t s) {
  switch (cache_dtype) {
    case KvCacheDType::kInt8: return rcq_typed<T, int8_t>(a, s);
    case KvCacheDType::kFp8E4M3: return rcq_typed<T, __nv_fp8_e4m3>(a, s);
  }
  return cudaErrorInvalidValue;
}
}  // namespace

cudaError_t launch_reshape_and_cache_quantized(const ReshapeAndCacheArgs& a, DType dtype, KvCacheDType cache_dtype,
                                               cudaStream_t stream) {
  if (a.num_tokens == 0 || a.num_kv_heads == 0 || a.head_dim == 0) return cudaSuccess;
  if (a.num_tokens > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  if (a.k_scale == nullptr || a.v_scale == nullptr) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32: return rcq_cache<float>(a, cache_dtype, stream);
    case DType::kFloat16: return rcq_cache<__half>(a, cache_dtype, stream);
    case DType::kBFloat16: return rcq_cache<__nv_bfloat16>(a, cache_dtype, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_copy_blocks(const int64_t* key_cache_ptrs, const int64_t* value_cache_ptrs,
                               const int64_t* block_mapping, int num_layers, int64_t num_pairs, int64_t num_blocks,
                               int64_t block_bytes, int align_bytes, cudaStream_t stream) {
  if (num_layers == 0 || num_pairs == 0 || block_bytes == 0) return cudaSuccess;
  if (num_pairs > 0x7fffffffLL || num_layers > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(num_layers));
  if (align_bytes % 16 == 0 && block_bytes % 16 == 0) {
    copy_blocks_kernel<int4><<<grid, 256, 0, stream>>>(key_cache_ptrs, value_cache_ptrs, block_mapping, num_blocks,
                                                       block_bytes / 16);
  } else if (align_bytes % 4 == 0 && block_bytes % 4 == 0) {
    copy_blocks_kernel<uint32_t><<<grid, 256, 0, stream>>>(key_cache_ptrs, value_cache_ptrs, block_mapping,
                                                           num_blocks, block_bytes / 4);
  } else if (align_bytes % 2 == 0 && block_bytes % 2 == 0) {
    copy_blocks_kernel<uint16_t><<<grid, 256, 0, stream>>>(key_cache_ptrs, value_cache_ptrs, block_mapping,
                                                           num_blocks, block_bytes / 2);
  } else {
    copy_blocks_kernel<uint8_t><<<grid, 256, 0, stream>>>(key_cache_ptrs, value_cache_ptrs, block_mapping, num_blocks,
                                                          block_bytes);
  }
  return cudaGetLastError();
}

}  // namespace pagellm::cuda
