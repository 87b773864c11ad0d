// Paged KV-cache writes and block copies over raw bytes (dtype-agnostic: pure data movement).
// Cache layout: [num_blocks, num_kv_heads, block_size, head_dim], contiguous.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace pagellm::cpu {

struct CacheWriteArgs {
  char* key_cache;
  char* value_cache;
  const char* key;
  const char* value;
  const int64_t* slots;
  int64_t num_tokens, num_heads, head_dim, block_size, elem_size;
  int64_t key_stride_t, key_stride_h, value_stride_t, value_stride_h;  // in elements
};

// cache[slot / bs, h, slot % bs, :] = src[t, h, :] for key and value; slot -1 is skipped.
inline void reshape_and_cache_kernel(const CacheWriteArgs& a) {
  const int64_t row_bytes = a.head_dim * a.elem_size;
  const int64_t head_bytes = a.block_size * row_bytes;
  const int64_t block_bytes = a.num_heads * head_bytes;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, a.num_heads * row_bytes));
  at::parallel_for(0, a.num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = a.slots[t];
      if (slot < 0) continue;
      const int64_t dst = (slot / a.block_size) * block_bytes + (slot % a.block_size) * row_bytes;
      for (int64_t h = 0; h < a.num_heads; ++h) {
        std::memcpy(a.key_cache + dst + h * head_bytes,
                    a.key + (t * a.key_stride_t + h * a.key_stride_h) * a.elem_size, row_bytes);
        std::memcpy(a.value_cache + dst + h * head_bytes,
                    a.value + (t * a.value_stride_t + h * a.value_stride_h) * a.elem_size, row_bytes);
      }
    }
  });
}

// For every layer l and pair p: caches[l][dst_p] = caches[l][src_p] (whole blocks).
inline void copy_blocks_kernel(char* const* key_caches, char* const* value_caches, int64_t num_layers,
                               const int64_t* mapping, int64_t num_pairs, const int64_t* block_bytes) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, block_bytes[0]));
  at::parallel_for(0, num_layers * num_pairs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t l = i / num_pairs, p = i % num_pairs;
      const int64_t nb = block_bytes[l];
      const int64_t src = mapping[2 * p] * nb, dst = mapping[2 * p + 1] * nb;
      if (src == dst) continue;
      std::memcpy(key_caches[l] + dst, key_caches[l] + src, nb);
      std::memcpy(value_caches[l] + dst, value_caches[l] + src, nb);
    }
  });
}

}  // namespace pagellm::cpu
