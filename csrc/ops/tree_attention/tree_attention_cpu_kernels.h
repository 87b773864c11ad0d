// Tree attention on the CPU (Medusa-style speculative verification). Sequence s's q_len tree tokens are the LAST
// q_len positions of its seq_lens[s] keys; the committed context [0, seq_len - q_len) is visible to every tree
// token, and tree token j (position seq_len - q_len + j) is visible to query token i of the sequence iff
// tree_mask[qsl[s] + i][j] != 0 (its ancestors and itself).
//
// Two paths, chosen per sequence so that every token gets the bits the plain (non-tree) step would give it
// (batch invariance: bf16 Medusa trees then decode exactly like plain greedy decoding):
// - "decode path" (sequences of at most kMultiQueryMaxLen tokens, and every sequence whose mask is not causal):
//   each token is one query of the decode kernel (decode_cpu_kernels.h) over its visible keys in position order,
//   the context then its visible tree tokens (a DecodeKeyTail maps them to their slots): the same 256-key
//   partitions, tiles and accumulation order as a plain decode of the token's root-to-node path.
// - "tile path" (longer causal sequences: prefill chunks): the prefill kernel's tiled flash attention
//   (prefill_cpu_kernels.h) with the mask applied to the key tiles that reach into the tree; on a causal mask it
//   skips exactly what the prefill kernel's causal mask skips, so it gives the prefill op's bits.
// The split mirrors attention/cpu_backend.py, which sends rows of <= MULTI_QUERY_MAX_LEN tokens through the
// decode kernel and longer ones through the prefill kernel.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/paged_attention/decode_cpu_kernels.h"
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

// Rows of at most this many tokens take the decode path (= attention/cpu_backend.py MULTI_QUERY_MAX_LEN).
constexpr int64_t kMultiQueryMaxLen = 16;

// True when rows [t0, t0 + q_len) of the mask are the causal mask (row i sees tree tokens 0..i).
inline bool mask_is_causal(const TreeMask& mask, int64_t t0, int64_t q_len) {
  for (int64_t i = 0; i < q_len; ++i) {
    const uint8_t* row = mask.data + (t0 + i) * mask.row_stride;
    for (int64_t j = 0; j < q_len; ++j)
      if ((row[j] != 0) != (j <= i)) return false;
  }
  return true;
}

// The decode path's arguments: one decode "sequence" per query token, reading the block-table row of the token's
// sequence; the keys past its context are its visible tree tokens (DecodeKeyTail, positions in tail_pos).
struct TreeDecodePlan {
  std::vector<int64_t> tokens;  // query row of each decode sequence
  std::vector<int32_t> tables, lens, tail_pos;
  std::vector<DecodeKeyTail> tails;
  int64_t table_width = 1, tail_width = 1;
};

template <typename T, typename C>
TreeDecodePlan plan_tree_decode(const PagedAttnArgs<T, C>& a, const TreeMask& mask, const std::vector<int64_t>& seqs) {
  TreeDecodePlan p;
  const int32_t* qsl = a.query_start_loc;
  for (int64_t s : seqs) {
    p.table_width = std::max<int64_t>(p.table_width, (a.seq_lens[s] + a.block_size - 1) / a.block_size);
    p.tail_width = std::max<int64_t>(p.tail_width, qsl[s + 1] - qsl[s]);
  }
  for (int64_t s : seqs)
    for (int64_t t = qsl[s]; t < qsl[s + 1]; ++t) p.tokens.push_back(t);
  const int64_t n = static_cast<int64_t>(p.tokens.size());
  p.tables.assign(n * p.table_width, 0);
  p.lens.assign(n, 0);
  p.tail_pos.assign(n * p.tail_width, 0);
  p.tails.assign(n, DecodeKeyTail{});
  int64_t i = 0;
  for (int64_t s : seqs) {
    const int64_t q_len = qsl[s + 1] - qsl[s], ctx = a.seq_lens[s] - q_len;
    const int64_t used = (a.seq_lens[s] + a.block_size - 1) / a.block_size;
    for (int64_t t = qsl[s]; t < qsl[s + 1]; ++t, ++i) {
      std::copy_n(a.block_tables + s * a.bt_stride, used, p.tables.begin() + i * p.table_width);
      int32_t* tail = p.tail_pos.data() + i * p.tail_width;
      int64_t visible = 0;
      for (int64_t j = 0; j < q_len; ++j)
        if (mask.data[t * mask.row_stride + j] != 0) tail[visible++] = static_cast<int32_t>(ctx + j);
      p.lens[i] = static_cast<int32_t>(ctx + visible);
      p.tails[i] = DecodeKeyTail{ctx, tail};
    }
  }
  return p;
}

// The decode path over sequences `seqs`: one decode call over their tokens (queries gathered into a block and
// outputs scattered back unless the tokens are the query rows 0, 1, 2, ...).
template <typename T, typename C>
void tree_decode_path(const PagedAttnArgs<T, C>& a, const TreeMask& mask, const std::vector<int64_t>& seqs) {
  const TreeDecodePlan p = plan_tree_decode(a, mask, seqs);
  const int64_t n = static_cast<int64_t>(p.tokens.size());
  if (n == 0) return;
  PagedAttnArgs<T, C> d = a;
  d.block_tables = p.tables.data();
  d.bt_stride = p.table_width;
  d.seq_lens = p.lens.data();
  d.num_seqs = n;
  d.query_start_loc = nullptr;
  bool gather = false;  // else decode sequence i is query row i
  for (int64_t i = 0; i < n && !gather; ++i) gather = p.tokens[i] != i;
  const int64_t row = a.num_heads * a.head_dim;
  std::vector<T> q, o;
  if (gather) {
    q.resize(n * row);
    o.resize(n * row);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < a.num_heads; ++h)
        std::copy_n(a.q_row(p.tokens[i], h), a.head_dim, q.data() + i * row + h * a.head_dim);
    d.query = q.data();
    d.out = o.data();
    d.q_stride_t = d.out_stride_t = row;
    d.q_stride_h = d.out_stride_h = a.head_dim;
  }
  paged_attention_decode_kernel(d, p.tails.data());
  if (!gather) return;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < a.num_heads; ++h)
      std::copy_n(o.data() + i * row + h * a.head_dim, a.head_dim, a.out_row(p.tokens[i], h));
}

// a: prefill arguments (query_start_loc set, window -1); mask: see TreeMask.
template <typename T, typename C>
void paged_tree_attention_kernel(const PagedAttnArgs<T, C>& a, const TreeMask& mask) {
  std::vector<int64_t> decode_seqs;
  std::vector<bool> tiled(a.num_seqs, false);
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t t0 = a.query_start_loc[s], q_len = a.query_start_loc[s + 1] - t0;
    tiled[s] = q_len > kMultiQueryMaxLen && mask_is_causal(mask, t0, q_len);
    if (!tiled[s] && q_len > 0) decode_seqs.push_back(s);
  }
  tree_decode_path(a, mask, decode_seqs);
  std::vector<PrefillItem> items;
  const int64_t Rp = prefill_items(a, items);
  items.erase(std::remove_if(items.begin(), items.end(), [&](const PrefillItem& it) { return !tiled[it.seq]; }),
              items.end());
  const int64_t n_items = static_cast<int64_t>(items.size());
  parallel_dynamic(n_items, [&](auto claim) {
    PrefillScratch w(a.head_dim, Rp);
    for (int64_t i = claim(); i < n_items; i = claim()) tree_item(a, mask, items[i], w);
  });
}

}  // namespace pagellm::cpu
