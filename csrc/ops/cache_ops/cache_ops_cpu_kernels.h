// Paged KV-cache writes and block copies. Float caches: raw bytes (dtype-agnostic, pure data movement);
// quantized caches: every (token, kv head) row quantized by its absmax (kv_quant_cpu.h).
// Cache layout: [num_blocks, num_kv_heads, block_size, head_dim], contiguous; scales [num_blocks, num_kv_heads,
// block_size] (one per row, so a row's scale index is its row index in the cache).
#pragma once

#include "ops/common/parallel.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "ops/cache_ops/kv_quant_cpu.h"

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
  pagellm::cpu::parallel_for(0, a.num_tokens, grain, [&](int64_t begin, int64_t end) {
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

template <typename T, typename C>
struct QuantCacheWriteArgs {
  C* key_cache;
  C* value_cache;
  float* k_scale;
  float* v_scale;
  const T* key;
  const T* value;
  const int64_t* slots;
  int64_t num_tokens, num_heads, head_dim, block_size;
  int64_t key_stride_t, key_stride_h, value_stride_t, value_stride_h;  // in elements
};

// Row (slot / bs, h, slot % bs) of the caches = quantize(src[t, h, :]), its scale into k_scale / v_scale at the
// same row index; slot -1 is skipped.
template <typename T, typename C>
void reshape_and_cache_quantized_kernel(const QuantCacheWriteArgs<T, C>& a) {
  const int64_t D = a.head_dim, bs = a.block_size;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, a.num_heads * D));
  pagellm::cpu::parallel_for(0, a.num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = a.slots[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < a.num_heads; ++h) {
        const int64_t row = ((slot / bs) * a.num_heads + h) * bs + slot % bs;
        a.k_scale[row] = quantize_row(a.key + t * a.key_stride_t + h * a.key_stride_h, a.key_cache + row * D, D);
        a.v_scale[row] = quantize_row(a.value + t * a.value_stride_t + h * a.value_stride_h, a.value_cache + row * D, D);
      }
    }
  });
}

// For every layer l and pair p: caches[l][dst_p] = caches[l][src_p] (whole blocks).
inline void copy_blocks_kernel(char* const* key_caches, char* const* value_caches, int64_t num_layers,
                               const int64_t* mapping, int64_t num_pairs, const int64_t* block_bytes) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, block_bytes[0]));
  pagellm::cpu::parallel_for(0, num_layers * num_pairs, grain, [&](int64_t begin, int64_t end) {
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

// One cache tensor of copy_slots: [num_blocks, num_heads, block_size, row_bytes] bytes.
struct SlotTensor {
  char* data;
  int64_t num_heads, block_size, row_bytes;
};

// For every tensor and pair p: the num_heads rows of slot mapping[2p + 1] = those of slot mapping[2p], every source
// copied out to `scratch` before any destination is written (a source may be an earlier pair's destination; a
// destination named twice ends with the later pair's row). A tree
// path moves a few slots of ~60 tensors: one thread, memcpy per row.
inline void copy_slots_kernel(const SlotTensor* tensors, int64_t num_tensors, const int64_t* mapping, int64_t num_pairs,
                              std::vector<char>& scratch) {
  for (int64_t t = 0; t < num_tensors; ++t) {
    const SlotTensor& c = tensors[t];
    const int64_t rb = c.row_bytes, bs = c.block_size;
    scratch.resize(static_cast<size_t>(num_pairs * c.num_heads * rb));
    auto row = [&](int64_t slot, int64_t h) {
      return c.data + (((slot / bs) * c.num_heads + h) * bs + slot % bs) * rb;
    };
    char* out = scratch.data();
    for (int64_t p = 0; p < num_pairs; ++p) {
      for (int64_t h = 0; h < c.num_heads; ++h, out += rb) std::memcpy(out, row(mapping[2 * p], h), rb);
    }
    const char* in = scratch.data();
    for (int64_t p = 0; p < num_pairs; ++p) {
      for (int64_t h = 0; h < c.num_heads; ++h, in += rb) std::memcpy(row(mapping[2 * p + 1], h), in, rb);
    }
  }
}

}  // namespace pagellm::cpu
