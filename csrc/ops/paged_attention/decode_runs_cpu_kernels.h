// Paged decode attention for runs of queries at consecutive positions of one sequence (a speculative verify row of
// 1 + k tokens, a short prompt, as the multi-query decode path of the cpu backend passes them: one query per token,
// each with its own context length and a copy of its row's block table).
//
// The plain decode kernel treats each query as a sequence of its own and streams the row's keys and values once per
// query. Here a work item is (run, context partition, kv head): the partition's key tiles are located, prefetched
// and loaded once and scored for every query of the run at once (its G heads per query are just more heads sharing
// the kv head), then each query's online softmax and value accumulation runs over the keys it sees. Per query the
// arithmetic is that of the plain kernel, operation for operation (the same per-head dot products, tiles,
// partitions, softmax updates and value FMAs in the same order), so every query gets bit-identical results:
// speculative verification stays token-identical to plain decoding in bf16.
#pragma once

#include <cstring>
#include <vector>

#include "ops/paged_attention/decode_cpu_kernels.h"

namespace pagellm::cpu {

// At most this many heads (queries x group) share one item's scratch: 16 queries of a 3-head group.
constexpr int64_t kDecodeRunMaxHeads = 48;

struct DecodeRun {
  int64_t first, count;  // queries first .. first + count - 1 (the last one sees the longest context)
};

// Consecutive queries s, s + 1 form a run when s + 1 is the next position of the same row: one more key, and the
// same blocks under all of its keys.
template <typename T, typename C>
std::vector<DecodeRun> plan_decode_runs(const PagedAttnArgs<T, C>& a) {
  const int64_t max_count = std::max<int64_t>(1, kDecodeRunMaxHeads / a.group());
  std::vector<DecodeRun> runs;
  for (int64_t s = 0; s < a.num_seqs;) {
    int64_t c = 1;
    while (s + c < a.num_seqs && c < max_count && a.seq_lens[s + c] == a.seq_lens[s + c - 1] + 1) {
      const int64_t blocks = (a.seq_lens[s + c] + a.block_size - 1) >> a.log2_block_size;
      if (std::memcmp(a.block_tables + s * a.bt_stride, a.block_tables + (s + c) * a.bt_stride,
                      blocks * sizeof(int32_t)) != 0) {
        break;
      }
      ++c;
    }
    runs.push_back({s, c});
    s += c;
  }
  return runs;
}

// Partition pi of every query of `run` that has one, kv head h: acc [Q * G, D], m / l [Q * G] per query and head
// (unnormalized, as decode_item leaves them), queries whose context ends before the partition left untouched.
template <typename T, typename C>
void decode_run_item(const PagedAttnArgs<T, C>& a, const DecodeRun& run, const std::vector<DecodePart>& parts,
                     const std::vector<int64_t>& part_off, int64_t pi, int64_t h, DecodeScratch& w, float* acc,
                     float* m, float* l) {
  const int64_t G = a.group(), D = a.head_dim;
  int64_t i0 = 0;  // the first query with a partition pi (queries grow by one key: a suffix of the run has it)
  while (part_off[run.first + i0] + pi >= part_off[run.first + i0 + 1]) ++i0;
  const int64_t nq = run.count - i0, first = run.first + i0, last = run.first + run.count - 1;
  PagedAttnArgs<T, C> wide = a;  // the run's queries as the heads of one kv head, for the tile's scores
  wide.num_heads = nq * G * a.num_kv_heads;
  const int64_t kbeg = parts[part_off[last] + pi].kbeg, kend_last = parts[part_off[last] + pi].kend;
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t x = i * G + g;
      if constexpr (use_bf16_dot<T, C>()) {
        std::memcpy(w.qb.data() + x * D, a.q_row(first + i, h * G + g), D * sizeof(T));
      } else {
        load_row_f32(a.q_row(first + i, h * G + g), w.qf.data() + x * D, D, a.scale);
      }
      m[x] = kNegInf;
      l[x] = 0.f;
    }
  }
  std::fill(acc, acc + nq * G * D, 0.f);
  auto** kp = reinterpret_cast<const C**>(w.kp.data());
  auto** vp = reinterpret_cast<const C**>(w.vp.data());
  for (int64_t start = kbeg; start < kend_last; start += kDecodeTile) {
    const int64_t n = std::min(kDecodeTile, kend_last - start);
    decode_tile_rows(a, last, h, start, n, w, kp, vp, DecodeKeyTail{});
    const int64_t nn = std::min(kDecodeTile, kend_last - start - n);
    if (nn > 0) decode_prefetch_rows(a, last, h, start + n, nn, w);
    for (int64_t j = std::max<int64_t>(nn, 0); j < kDecodeTile + 1; ++j) w.pf[2 * j] = w.pf[2 * j + 1] = kp[0];
    decode_tile_scores(wide, w, static_cast<const C* const*>(kp), n);
    int64_t full = nq;  // queries [full, nq) see the whole tile: their values accumulate as one head group
    for (int64_t i = nq - 1; i >= 0 && parts[part_off[first + i] + pi].kend - start >= n; --i) full = i;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t ni = std::min(n, parts[part_off[first + i] + pi].kend - start);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t x = i * G + g;
        float* sg = w.sc.data() + x * kDecodeTile;
        if (ni <= 0) continue;
        if (a.softcap > 0.f) apply_softcap(sg, ni, a.softcap);
        const float corr = decode_softmax(a, sg, ni, m[x], l[x]);
        if (corr != 1.0f) store_row(acc + x * D, acc + x * D, D, corr);
        if constexpr (PagedAttnArgs<T, C>::kQuantized) mul_elementwise(sg, w.vs.data(), ni);
      }
      if (i < full && ni > 0) {
        decode_tile_accum(a, G, acc + i * G * D, static_cast<const float*>(w.sc.data() + i * G * kDecodeTile),
                          static_cast<const C* const*>(vp), ni);
      }
    }
    if (full < nq) {
      decode_tile_accum(a, (nq - full) * G, acc + full * G * D,
                        static_cast<const float*>(w.sc.data() + full * G * kDecodeTile),
                        static_cast<const C* const*>(vp), n);
    }
  }
}

// The decode kernel with runs of consecutive queries fused (no sliding window, no key tails: the plain kernel
// otherwise, and for calls without a run of two).
template <typename T, typename C>
void paged_attention_decode_runs_kernel(const PagedAttnArgs<T, C>& a) {
  const std::vector<DecodeRun> runs = a.window > 0 ? std::vector<DecodeRun>{} : plan_decode_runs(a);
  if (runs.empty() || static_cast<int64_t>(runs.size()) == a.num_seqs) {
    paged_attention_decode_kernel(a);
    return;
  }
  std::vector<int64_t> part_off;
  const std::vector<DecodePart> parts = plan_decode(a, part_off);
  const int64_t G = a.group(), D = a.head_dim, H = a.num_kv_heads;
  const bool split = static_cast<int64_t>(parts.size()) > a.num_seqs;  // as the plain kernel decides
  const int64_t item_floats = G * (D + 2);
  std::vector<float> partials(split ? parts.size() * H * item_floats : 0);
  std::vector<std::pair<int64_t, int64_t>> work;  // (run, partition index of its longest query)
  for (int64_t r = 0; r < static_cast<int64_t>(runs.size()); ++r) {
    const int64_t last = runs[r].first + runs[r].count - 1;
    for (int64_t pi = 0; pi < part_off[last + 1] - part_off[last]; ++pi) work.emplace_back(r, pi);
  }
  const int64_t n_items = static_cast<int64_t>(work.size()) * H;
  const int64_t max_q = std::max<int64_t>(1, kDecodeRunMaxHeads / G);
  parallel_dynamic(n_items, [&](auto claim) {
    DecodeScratch w(max_q * G, D);
    std::vector<float> acc(max_q * G * D), m(max_q * G), l(max_q * G);
    for (int64_t i = claim(); i < n_items; i = claim()) {
      const auto [r, pi] = work[i / H];
      const int64_t h = i % H;
      const DecodeRun& run = runs[r];
      decode_run_item(a, run, parts, part_off, pi, h, w, acc.data(), m.data(), l.data());
      int64_t x = 0;  // the queries that had partition pi, in order
      for (int64_t s = run.first; s < run.first + run.count; ++s) {
        const int64_t p = part_off[s] + pi;
        if (p >= part_off[s + 1]) continue;
        for (int64_t g = 0; g < G; ++g, ++x) {
          if (split) {
            float* it = partials.data() + (p * H + h) * item_floats;
            std::memcpy(it + g * D, acc.data() + x * D, D * sizeof(float));
            it[G * D + g] = m[x];
            it[G * D + G + g] = l[x];
          } else {
            write_normalized(a.out_row(s, h * G + g), acc.data() + x * D, l[x], D);
          }
        }
      }
    }
  });
  if (split) decode_reduce(a, part_off, partials.data());
}

}  // namespace pagellm::cpu
