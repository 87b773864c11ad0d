// Tree attention on the CPU (Medusa-style speculative verification). Sequence s's q_len tree tokens are the LAST
// q_len positions of its seq_lens[s] keys; the committed context [0, seq_len - q_len) is visible to every tree
// token, and tree token j (position seq_len - q_len + j) is visible to query token i of the sequence iff
// tree_mask[qsl[s] + i][j] != 0 (its ancestors and itself).
//
// Two paths, chosen per sequence so that every token gets the bits the plain (non-tree) step would give it
// (batch invariance: bf16 Medusa trees then decode exactly like plain greedy decoding):
// - "decode path" (sequences of at most kMultiQueryMaxLen tokens, and every sequence whose mask is not causal):
//   each token is one query of the decode kernel's arithmetic (decode_cpu_kernels.h) over its visible keys in
//   position order, the context then its visible tree tokens (a DecodeKeyTail maps them to their slots): the same
//   256-key partitions, tiles and accumulation order as a plain decode of the token's root-to-node path. A tree's
//   tokens share one pass over their common context (tree_runs_cpu_kernels.h).
// - "tile path" (longer causal sequences: prefill chunks): each such sequence through the prefill op's kernel
//   (prefill_dispatch_cpu.h), so it gets the prefill op's bits.
// The split mirrors attention/cpu_backend.py, which sends rows of <= MULTI_QUERY_MAX_LEN tokens through the
// decode kernel and longer ones through the prefill kernel.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/paged_attention/decode_cpu_kernels.h"
#include "ops/paged_attention/prefill_dispatch_cpu.h"
#include "ops/tree_attention/tree_runs_cpu_kernels.h"

namespace pagellm::cpu {

// tree_mask bytes (bool / uint8): row t (a query token of the call), column j (tree token j of t's sequence).
struct TreeMask {
  const uint8_t* data;
  int64_t row_stride;
};

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
  std::vector<TreeRun> runs;  // each tree's decode sequences, in chunks that fit one item's scratch
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
  const int64_t max_run = std::max<int64_t>(1, kTreeRunMaxHeads / a.group());
  for (int64_t s : seqs) {
    const int64_t q_len = qsl[s + 1] - qsl[s], ctx = a.seq_lens[s] - q_len;
    const int64_t used = (a.seq_lens[s] + a.block_size - 1) / a.block_size;
    for (int64_t first = 0; first < q_len; first += max_run)
      p.runs.push_back({i + first, std::min(max_run, q_len - first), ctx});
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

// The decode path over sequences `seqs`: one decode pass over their tokens, each tree's fused (queries gathered into
// a block and outputs scattered back unless the tokens are the query rows 0, 1, 2, ...).
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
  paged_tree_runs_kernel(d, p.tails.data(), p.runs);
  if (!gather) return;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < a.num_heads; ++h)
      std::copy_n(o.data() + i * row + h * a.head_dim, a.head_dim, a.out_row(p.tokens[i], h));
}

// The tile path: a causal chain is a prefill chunk, so sequence s alone through the prefill op's kernel (its
// bits whichever kernel prefill_dispatch_cpu.h picks: fp32 FMA, bf16 pair dots or AMX tiles).
template <typename T, typename C>
void tree_prefill_path(const PagedAttnArgs<T, C>& a, int64_t s) {
  const int32_t t0 = a.query_start_loc[s];
  const int32_t qsl[2] = {0, a.query_start_loc[s + 1] - t0};
  PagedAttnArgs<T, C> p = a;
  p.query = a.query + t0 * a.q_stride_t;
  p.out = a.out + t0 * a.out_stride_t;
  p.block_tables = a.block_tables + s * a.bt_stride;
  p.seq_lens = a.seq_lens + s;
  p.query_start_loc = qsl;
  p.num_seqs = 1;
  run_paged_attention_prefill(p);
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
  for (int64_t s = 0; s < a.num_seqs; ++s)
    if (tiled[s]) tree_prefill_path(a, s);
}

}  // namespace pagellm::cpu
