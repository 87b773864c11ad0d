// Host-side, torch-free entry points of the paged KV-cache CUDA kernels (implemented in cache_kernels.cu).
// Cache layout (every device): [num_blocks, num_kv_heads, block_size, head_dim], contiguous.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cache_ops/kv_cache_dtype.h"
#include "ops/cuda_common/dtype.h"

namespace pagellm::cuda {

// key_cache[slot // bs, h, slot % bs, :] = key[t, h, :] (same for value) for every t with slot_mapping[t] >= 0.
// key/value rows: element (t, h, d) at t * tok_stride + h * head_stride + d. elem_size is 2 or 4 (bytes); the copy
// is dtype-agnostic. Slots outside [0, num_blocks * block_size) are skipped (never written out of bounds).
struct ReshapeAndCacheArgs {
  void* key_cache;
  void* value_cache;
  const void* key;
  const void* value;
  const int64_t* slot_mapping;
  int64_t num_tokens;
  int64_t key_tok_stride, key_head_stride;      // in elements
  int64_t value_tok_stride, value_head_stride;  // in elements
  int num_kv_heads;
  int head_dim;
  int block_size;
  int64_t num_blocks;
  int elem_size;
  float* k_scale = nullptr;  // quantized caches only: [num_blocks, num_kv_heads, block_size]
  float* v_scale = nullptr;
};
cudaError_t launch_reshape_and_cache(const ReshapeAndCacheArgs& args, cudaStream_t stream);

// The same into a quantized cache: key/value of `dtype` (elem_size unused), every (token, head) row quantized by
// its absmax into `cache_dtype` values and its fp32 scale into k_scale / v_scale at the row's index.
cudaError_t launch_reshape_and_cache_quantized(const ReshapeAndCacheArgs& args, DType dtype, KvCacheDType cache_dtype,
                                               cudaStream_t stream);

// For every layer l and pair p: cache_l[dst_p] = cache_l[src_p] for the key and value caches.
// key_cache_ptrs / value_cache_ptrs: device arrays of num_layers base addresses (as int64);
// block_mapping: device int64 [num_pairs, 2] (src, dst). block_bytes = num_kv_heads * block_size * head_dim * elem_size.
// align_bytes: an alignment (16, 4, 2 or 1) every cache base address has; any element type (a byte copy). Pairs naming a block outside
// [0, num_blocks) are skipped.
cudaError_t launch_copy_blocks(const int64_t* key_cache_ptrs, const int64_t* value_cache_ptrs,
                               const int64_t* block_mapping, int num_layers, int64_t num_pairs, int64_t num_blocks,
                               int64_t block_bytes, int align_bytes, cudaStream_t stream);

}  // namespace pagellm::cuda
