// The decode path of paged_tree_attention with the queries of one tree fused (a Medusa verify row of 1 + k nodes).
//
// The plain decode kernel takes each tree token as a sequence of its own and streams the row's committed context
// once per token. Every token of a tree sees the same committed context, so here a work item is (tree, context
// partition, kv head), as decode_runs_cpu_kernels.h does for a chain: the partition's context tiles are located,
// prefetched and loaded once and scored for all the tree's tokens at once (their G heads per token are more heads
// sharing the kv head). The tiles that reach past the context hold, for each token, its own keys (its ancestors and
// itself, through its DecodeKeyTail): those are loaded and scored token by token. Per token the arithmetic is the
// plain kernel's over the token's keys, operation for operation (the same tiles, partitions, per-head dot products,
// softmax updates and value FMAs in the same order), so every token gets the bits of a plain decode of its
// root-to-node path: bf16 tree verification stays token-identical to plain decoding.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops/paged_attention/decode_cpu_kernels.h"

namespace pagellm::cpu {

// At most this many heads (tokens x group) share one item's scratch, as in decode_runs (16 tokens of a 3-head group).
constexpr int64_t kTreeRunMaxHeads = 48;

// Decode sequences [first, first + count) are tokens of one tree; keys [0, context) are their shared context.
struct TreeRun {
  int64_t first, count, context;
};

// Scores of token slot i's G heads (qb / qf rows i * G ..) against the rows kp[0 .. n) into sc rows i * G ..: the
// plain kernel's decode_tile_scores for that token alone (each score is its own dot product, whatever else the
// scratch holds).
template <typename T, typename C>
inline void tree_token_scores(const PagedAttnArgs<T, C>& d, DecodeScratch& w, int64_t i, const C* const* kp,
                              int64_t n) {
  const int64_t G = d.group(), D = d.head_dim;
#ifdef PAGELLM_DECODE_BF16_DOT
  if constexpr (use_bf16_dot<T, C>()) {
    decode_scores_bf16(w.qb.data() + i * G * D, reinterpret_cast<const c10::BFloat16* const*>(kp), n, D, G, d.scale,
                       w.sc.data() + i * G * kDecodeTile, static_cast<const void* const*>(w.pf.data()));
    return;
  }
#endif
  for_head_chunks<ScoresK>(G, static_cast<const float*>(w.qf.data() + i * G * D), kp, n, D,
                           w.sc.data() + i * G * kDecodeTile, static_cast<const void* const*>(w.pf.data()));
}

// The K and V rows of keys [kbeg, kend) of decode sequence q's row, kv head h, prefetched block run by block run:
// an item's shared context is requested from memory at once. In a step the layers' weights stream between two calls,
// so these rows are cold; the plain kernel hid that by prefetching each next item's first tile, and a tree item
// streams as much context as seven of its items did.
template <typename T, typename C>
inline void prefetch_context(const PagedAttnArgs<T, C>& d, int64_t q, int64_t h, int64_t kbeg, int64_t kend) {
  for (int64_t p = kbeg; p < kend;) {
    const int64_t run = std::min(kend - p, d.block_size - (p & (d.block_size - 1)));
    prefetch_bytes(d.row(d.key_cache, q, p, h), run * d.head_dim * static_cast<int64_t>(sizeof(C)));
    prefetch_bytes(d.row(d.value_cache, q, p, h), run * d.head_dim * static_cast<int64_t>(sizeof(C)));
    p += run;
  }
}

// Partition pi, kv head h of the run's tokens that have one (their decode indices left in `qs`): acc [Q * G, D],
// m / l [Q * G] per token and head, unnormalized (as decode_item leaves them).
template <typename T, typename C>
void tree_run_item(const PagedAttnArgs<T, C>& d, const DecodeKeyTail* tails, const TreeRun& run,
                   const std::vector<DecodePart>& parts, const std::vector<int64_t>& part_off, int64_t pi, int64_t h,
                   DecodeScratch& w, std::vector<int64_t>& qs, float* acc, float* m, float* l) {
  static_assert(!PagedAttnArgs<T, C>::kQuantized, "tree attention reads float caches");
  const int64_t G = d.group(), D = d.head_dim;
  qs.clear();
  int64_t kbeg = 0, kend_max = 0;
  for (int64_t q = run.first; q < run.first + run.count; ++q) {
    if (part_off[q] + pi >= part_off[q + 1]) continue;
    qs.push_back(q);
    kbeg = parts[part_off[q] + pi].kbeg;  // pi * kDecodePartition for every token (no window)
    kend_max = std::max(kend_max, parts[part_off[q] + pi].kend);
  }
  const int64_t nq = static_cast<int64_t>(qs.size());
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t x = i * G + g;
      if constexpr (use_bf16_dot<T, C>()) {
        std::memcpy(w.qb.data() + x * D, d.q_row(qs[i], h * G + g), D * sizeof(T));
      } else {
        load_row_f32(d.q_row(qs[i], h * G + g), w.qf.data() + x * D, D, d.scale);
      }
      m[x] = kNegInf;
      l[x] = 0.f;
    }
  }
  std::fill(acc, acc + nq * G * D, 0.f);
  PagedAttnArgs<T, C> wide = d;  // the tokens as the heads of one kv head, for the shared tiles' scores
  wide.num_heads = nq * G * d.num_kv_heads;
  auto** kp = reinterpret_cast<const C**>(w.kp.data());
  auto** vp = reinterpret_cast<const C**>(w.vp.data());
  for (int64_t start = kbeg; start < kend_max; start += kDecodeTile) {
    if (start + kDecodeTile <= run.context) {  // a whole tile of shared context: every token sees all 32 keys
      decode_tile_rows(d, qs[0], h, start, kDecodeTile, w, kp, vp, DecodeKeyTail{});
      const int64_t nn = std::min(kDecodeTile, kend_max - start - kDecodeTile);
      if (nn > 0) decode_prefetch_rows(d, qs[0], h, start + kDecodeTile, nn, w);
      for (int64_t j = std::max<int64_t>(nn, 0); j < kDecodeTile + 1; ++j) w.pf[2 * j] = w.pf[2 * j + 1] = kp[0];
      decode_tile_scores(wide, w, static_cast<const C* const*>(kp), kDecodeTile);
      for (int64_t x = 0; x < nq * G; ++x) {
        float* sx = w.sc.data() + x * kDecodeTile;
        if (d.softcap > 0.f) apply_softcap(sx, kDecodeTile, d.softcap);
        const float corr = decode_softmax(d, sx, kDecodeTile, m[x], l[x]);
        if (corr != 1.0f) store_row(acc + x * D, acc + x * D, D, corr);
      }
      decode_tile_accum(d, nq * G, acc, static_cast<const float*>(w.sc.data()), static_cast<const C* const*>(vp),
                        kDecodeTile);
      continue;
    }
    for (int64_t i = 0; i < nq; ++i) {  // the tile reaches the tree: each token its context keys, then its own
      const int64_t q = qs[i], n = std::min(kDecodeTile, parts[part_off[q] + pi].kend - start);
      if (n <= 0) continue;
      decode_tile_rows(d, q, h, start, n, w, kp, vp, tails[q]);
      for (int64_t j = 0; j < kDecodeTile + 1; ++j) w.pf[2 * j] = w.pf[2 * j + 1] = kp[0];  // rows in L1 already
      tree_token_scores(d, w, i, static_cast<const C* const*>(kp), n);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t x = i * G + g;
        float* sx = w.sc.data() + x * kDecodeTile;
        if (d.softcap > 0.f) apply_softcap(sx, n, d.softcap);
        const float corr = decode_softmax(d, sx, n, m[x], l[x]);
        if (corr != 1.0f) store_row(acc + x * D, acc + x * D, D, corr);
      }
      decode_tile_accum(d, G, acc + i * G * D, static_cast<const float*>(w.sc.data() + i * G * kDecodeTile),
                        static_cast<const C* const*>(vp), n);
    }
  }
}

// d: one decode sequence per tree token (tree_attention_cpu_kernels.h's plan; tails[q]: token q's visible tree
// tokens), runs: the trees' tokens in chunks of at most kTreeRunMaxHeads / G. Trees of one token each (decode rows)
// take the plain kernel, which prefetches across items.
template <typename T, typename C>
void paged_tree_runs_kernel(const PagedAttnArgs<T, C>& d, const DecodeKeyTail* tails,
                            const std::vector<TreeRun>& runs) {
  if (static_cast<int64_t>(runs.size()) == d.num_seqs) {
    paged_attention_decode_kernel(d, tails);
    return;
  }
  std::vector<int64_t> part_off;
  const std::vector<DecodePart> parts = plan_decode(d, part_off);
  const int64_t G = d.group(), D = d.head_dim, H = d.num_kv_heads;
  const bool split = static_cast<int64_t>(parts.size()) > d.num_seqs;  // as the plain kernel decides
  const int64_t item_floats = G * (D + 2);
  std::vector<float> partials(split ? parts.size() * H * item_floats : 0);
  std::vector<std::pair<int64_t, int64_t>> work;  // (run, partition index)
  for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r) {
    int64_t num_parts = 0;
    for (int64_t q = runs[r].first; q < runs[r].first + runs[r].count; ++q)
      num_parts = std::max(num_parts, part_off[q + 1] - part_off[q]);
    for (int64_t pi = 0; pi < num_parts; ++pi) work.emplace_back(r, pi);
  }
  const int64_t n_items = static_cast<int64_t>(work.size()) * H;
  const int64_t max_q = std::max<int64_t>(1, kTreeRunMaxHeads / G);
  parallel_dynamic(n_items, [&](auto claim) {
    DecodeScratch w(max_q * G, D);
    std::vector<float> acc(max_q * G * D), m(max_q * G), l(max_q * G);
    std::vector<int64_t> qs;
    qs.reserve(max_q);
    auto prefetch_item = [&](int64_t i) {  // its shared context (the tree's own rows were just written: cached)
      const auto [r, pi] = work[i / H];
      const int64_t kbeg = pi * kDecodePartition;
      prefetch_context(d, runs[r].first, i % H, kbeg, std::min(runs[r].context, kbeg + kDecodePartition));
    };
    // Each thread claims one item ahead and prefetches it while the current one runs.
    int64_t i = claim(), ahead = i < n_items ? claim() : n_items;
    if (i < n_items) prefetch_item(i);
    for (; i < n_items; i = ahead, ahead = claim()) {
      if (ahead < n_items) prefetch_item(ahead);
      const auto [r, pi] = work[i / H];
      const int64_t h = i % H;
      tree_run_item(d, tails, runs[r], parts, part_off, pi, h, w, qs, acc.data(), m.data(), l.data());
      for (int64_t x = 0; x < static_cast<int64_t>(qs.size()); ++x) {
        const int64_t p = part_off[qs[x]] + pi;
        for (int64_t g = 0; g < G; ++g) {
          const float* ax = acc.data() + (x * G + g) * D;
          if (split) {
            float* it = partials.data() + (p * H + h) * item_floats;
            std::memcpy(it + g * D, ax, D * sizeof(float));
            it[G * D + g] = m[x * G + g];
            it[G * D + G + g] = l[x * G + g];
          } else {
            write_normalized(d.out_row(qs[x], h * G + g), ax, l[x * G + g], D);
          }
        }
      }
    }
  });
  if (split) decode_reduce(d, part_off, partials.data());
}

}  // namespace pagellm::cpu
