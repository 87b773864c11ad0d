// Shared pieces of the CPU paged-attention kernels: argument bundle, paged cache addressing,
// soft-capping and a dynamically scheduled parallel loop (work items of very different cost).
#pragma once

#include "ops/common/parallel.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

#include "ops/cache_ops/kv_quant_cpu.h"
#include "ops/common/cpu_vec.h"

namespace pagellm::cpu {

// Cache: [num_blocks, num_kv_heads, block_size, head_dim] contiguous, of C (= T for a float cache; int8_t or
// c10::Float8_e4m3fn for a quantized one, read with k_scale / v_scale [num_blocks, num_kv_heads, block_size]:
// one fp32 scale per row, at the row's index). Query/out: [tokens, heads, head_dim] of T with arbitrary
// token/head strides (last dim contiguous).
template <typename T, typename C = T>
struct PagedAttnArgs {
  static constexpr bool kQuantized = kIsQuantizedCache<C>;
  T* out;
  const T* query;
  const C* key_cache;
  const C* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;  // prefill only
  int64_t bt_stride;
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, log2_block_size;
  int64_t q_stride_t, q_stride_h, out_stride_t, out_stride_h;
  int64_t cache_block_stride, cache_head_stride;
  float scale;
  int64_t window;  // -1 = full context
  float softcap;   // 0 = off
  const float* k_scale = nullptr;  // quantized caches only
  const float* v_scale = nullptr;

  int64_t group() const { return num_heads / num_kv_heads; }

  // Index of the row of token `pos` of sequence `s` for kv head `h` (the row is cache + index * head_dim;
  // a quantized row's scale is scales[index]). Rows of one block and head are consecutive indices.
  int64_t row_index(int64_t s, int64_t pos, int64_t h) const {
    const int64_t block = block_tables[s * bt_stride + (pos >> log2_block_size)];
    return (block * num_kv_heads + h) * block_size + (pos & (block_size - 1));
  }
  // Row of token `pos` of sequence `s` for kv head `h` in `cache`.
  const C* row(const C* cache, int64_t s, int64_t pos, int64_t h) const {
    const int64_t block = block_tables[s * bt_stride + (pos >> log2_block_size)];
    return cache + block * cache_block_stride + h * cache_head_stride + (pos & (block_size - 1)) * head_dim;
  }
  // Dequantization factor of a row (1 for a float cache).
  float row_scale(const float* scales, int64_t index) const {
    if constexpr (kQuantized) return scales[index];
    return 1.0f;
  }
  const T* q_row(int64_t t, int64_t head) const { return query + t * q_stride_t + head * q_stride_h; }
  T* out_row(int64_t t, int64_t head) const { return out + t * out_stride_t + head * out_stride_h; }
  // First key position visible to the query at absolute position p.
  int64_t window_begin(int64_t p) const { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }
};

// x = softcap * tanh(scale * x / softcap) on n values (scale: for scores that come unscaled).
inline void apply_softcap(float* x, int64_t n, float softcap, float scale = 1.0f) {
  const VecF c = vset1(softcap), inv = vset1(scale / softcap);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(x + i, vmul(c, vtanh(vmul(vload(x + i), inv))));
  if (i < n) {
    const int m = static_cast<int>(n - i);
    vstore(x + i, vmul(c, vtanh(vmul(vload(x + i, m), inv))), m);
  }
}

// Runs body(claim) on every thread of parallel_for; claim() hands out item indices 0, 1, ...
// (body loops until claim() >= n). Per-thread scratch lives inside body.
template <typename Body>
void parallel_dynamic(int64_t n, const Body& body) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  auto claim = [&next]() { return next.fetch_add(1, std::memory_order_relaxed); };
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pagellm::cpu::num_threads(), n));
  pagellm::cpu::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) body(claim);
  });
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Lane numbers, to mask a vector's lanes >= n without a masked store-reload (vselect_lt against n).
alignas(64) constexpr float kLaneIndex[kLanes] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// The online softmax's running-max step over one tile's n scores: returns the new max, and in corr the factor that
// rescales what was accumulated under the old max m: exp(m - m_new), without the libm call where its value is known
// exactly (0 on the first tile, m = -inf; 1 while the running max holds).
inline float running_max_update(const float* s, int64_t n, float m, float& corr) {
  VecF mx = vset1(kNegInf);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) mx = vmax(mx, vload(s + i));
  float mt = vmaxall(mx);
  for (; i < n; ++i) mt = std::max(mt, s[i]);
  const float m_new = std::max(m, mt);
  corr = m == kNegInf ? 0.0f : (m_new == m ? 1.0f : std::exp(m - m_new));
  return m_new;
}

}  // namespace pagellm::cpu
