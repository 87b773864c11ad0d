// Tree attention on the CPU (Medusa-style speculative verification): the prefill kernel's tiled flash attention
// (prefill_cpu_kernels.h: transposed tiles, online softmax across query rows) with a tree mask instead of the
// causal one. Sequence s's q_len tree tokens are the LAST q_len positions of its seq_lens[s] keys; the committed
// context [0, seq_len - q_len) is visible to every tree token, and tree token j (position seq_len - q_len + j) is
// visible to query token i of the sequence iff tree_mask[qsl[s] + i][j] != 0 (its ancestors and itself).
// Work item = (sequence, kv head, query tile), as in prefill; the tree mask is applied to the key tiles that
// reach into the tree (the context tiles are unmasked).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/paged_attention/prefill_cpu_kernels.h"

namespace pagellm::cpu {

// tree_mask bytes (bool / uint8): row t (a query token of the call), column j (tree token j of t's sequence).
struct TreeMask {
  const uint8_t* data;
  int64_t row_stride;
};

// Kf / Vf <- fp32 rows of keys [start, start + n) of the item's sequence and kv head.
template <typename T, typename C>
inline void load_kv_tile(const PagedAttnArgs<T, C>& a, const PrefillItem& it, PrefillScratch& w, int64_t start,
                         int64_t n) {
  const int64_t D = a.head_dim;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t idx = a.row_index(it.seq, start + j, it.head);
    load_row_f32(a.key_cache + idx * D, w.Kf.data() + j * D, D, a.row_scale(a.k_scale, idx));
    load_row_f32(a.value_cache + idx * D, w.Vf.data() + j * D, D, a.row_scale(a.v_scale, idx));
  }
}

// ST [n][Rp] = Kf . QT (rows of Kf past n are read but their scores are never used).
inline void score_tile(PrefillScratch& w, int64_t n) {
  const int64_t n8 = (n + 7) / 8 * 8;
  for (int64_t j0 = 0; j0 < n8; j0 += 8) {
    int64_t rv = 0;
    for (; rv + 2 * kLanes <= w.Rp; rv += 2 * kLanes) score_block<2>(w.Kf.data(), w.QT.data(), w.ST.data(), w.D, w.Rp, j0, rv);
    if (rv < w.Rp) score_block<1>(w.Kf.data(), w.QT.data(), w.ST.data(), w.D, w.Rp, j0, rv);
  }
}

// OT += Vf^T . P (P = ST after the softmax).
inline void pv_tile(PrefillScratch& w, int64_t n) {
  for (int64_t d0 = 0; d0 < w.D; d0 += 8) {
    int64_t rv = 0;
    for (; rv + 2 * kLanes <= w.Rp; rv += 2 * kLanes) pv_block<2>(w.Vf.data(), w.ST.data(), w.OT.data(), w.D, w.Rp, n, d0, rv);
    if (rv < w.Rp) pv_block<1>(w.Vf.data(), w.ST.data(), w.OT.data(), w.D, w.Rp, n, d0, rv);
  }
}

// Sets ST to -inf where key start + j is a tree token (>= ctx) that the row's query may not see. Padded rows
// (past the item's rows) repeat the last token's mask, as prefill_load_queries repeats its position.
template <typename T, typename C>
inline void tree_mask_tile(const PagedAttnArgs<T, C>& a, const TreeMask& mask, const PrefillItem& it,
                           PrefillScratch& w, int64_t q_base, int64_t ctx, int64_t start, int64_t n) {
  const int64_t G = a.group(), rows = (it.t1 - it.t0) * G;
  for (int64_t j = std::max<int64_t>(0, ctx - start); j < n; ++j) {
    const int64_t node = start + j - ctx;
    float* s = w.ST.data() + j * w.Rp;
    for (int64_t r = 0; r < w.Rp; ++r) {
      const int64_t t = q_base + it.t0 + std::min(r, rows - 1) / G;
      if (mask.data[t * mask.row_stride + node] == 0) s[r] = kNegInf;
    }
  }
}

template <typename T, typename C>
void tree_item(const PagedAttnArgs<T, C>& a, const TreeMask& mask, const PrefillItem& it, PrefillScratch& w) {
  const int64_t G = a.group(), D = a.head_dim, Rp = w.Rp;
  const PrefillSpan span = prefill_span(a, it);
  const int64_t ctx = span.pos_base, end = a.seq_lens[it.seq];
  prefill_load_queries(a, it, w, span.q_base, span.pos_base);
  for (int64_t start = 0; start < end; start += kKeyTile) {
    const int64_t n = std::min(kKeyTile, end - start);
    load_kv_tile(a, it, w, start, n);
    score_tile(w, n);
    if (a.softcap > 0.f) apply_softcap(w.ST.data(), n * Rp, a.softcap);
    if (start + n > ctx) tree_mask_tile(a, mask, it, w, span.q_base, ctx, start, n);
    softmax_tile(w, n);  // a row with every key masked so far keeps l = 0 (m starts finite)
    pv_tile(w, n);
  }
  for (int64_t r = 0; r < (it.t1 - it.t0) * G; ++r) {
    for (int64_t d = 0; d < D; ++d) w.row[d] = w.OT[d * Rp + r];
    const float l = w.l[r];
    store_row(w.row.data(), a.out_row(span.q_base + it.t0 + r / G, it.head * G + r % G), D, l > 0.f ? 1.0f / l : 0.f);
  }
}

// a: prefill arguments (query_start_loc set, window -1); mask: see TreeMask.
template <typename T, typename C>
void paged_tree_attention_kernel(const PagedAttnArgs<T, C>& a, const TreeMask& mask) {
  std::vector<PrefillItem> items;
  const int64_t Rp = prefill_items(a, items);
  const int64_t n_items = static_cast<int64_t>(items.size());
  parallel_dynamic(n_items, [&](auto claim) {
    PrefillScratch w(a.head_dim, Rp);
    for (int64_t i = claim(); i < n_items; i = claim()) tree_item(a, mask, items[i], w);
  });
}

}  // namespace pagellm::cpu
