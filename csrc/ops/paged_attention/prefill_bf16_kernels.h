// Prefill attention for a bf16 cache with bf16 pair dots (vdot_bf16: vdpbf16ps on AVX512-BF16, its exact
// emulation in the avx2 library, so both libraries give the same bits), for CPUs without AMX: the work items,
// transposed fp32 scores ST [keys][rows], masks and online softmax of prefill_cpu_kernels.h, with both
// products as bf16 pair dots (half the instructions of the fp32 broadcast-FMA tiles, no fp32 copies of K / V):
//   ST [keys][rows]  = K . Q^T   vector = 16 query rows of QB (dims 2p, 2p+1 of each row side by side, packed
//                                once per item, unscaled), times key pair p broadcast straight from its cache row
//   OT [dims][rows] += V^T . P   vector = 16 rows of PB (probabilities of keys 2p, 2p+1, bf16, written by the
//                                softmax), times the value pair (keys 2p, 2p+1; one dim) broadcast from VB
// Numerics as the AMX path: bf16 products are exact and accumulate in fp32, so the scores match the FMA
// kernel's to fp32 rounding; the probabilities enter P.V rounded to bf16 (from vexp_lowp) and the softmax sum
// adds those rounded values, so each output row is an exactly normalised average of the values. The softmax
// scale is applied in the softmax (folded into the soft-cap when there is one).
#pragma once

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ops/common/transpose_avx512.h"  // (the avx512 library)
#include "ops/paged_attention/prefill_cpu_kernels.h"

namespace pagellm::cpu {

#ifdef PAGELLM_BF16_DOT
#define PAGELLM_HAVE_PREFILL_BF16 1

// Query rows per work item: GQA 3 (SmolLM2) fills 48 rows with 16 tokens; the register blocks take 32 + 16.
constexpr int64_t kPrefillBf16Rows = 48;
// Keys per tile step (a multiple of 16): each step rescales the output accumulator once.
constexpr int64_t kBf16Keys = 64;

struct PrefillBf16Scratch : PrefillScratch {
  std::vector<uint32_t> QB;         // [D/2][Rp] query pairs (dims 2p, 2p+1) per row, rows past the item zero
  std::vector<uint32_t> VB;         // [kBf16Keys/2][D] value pairs (keys 2p, 2p+1) per dim, keys past n zero
  std::vector<uint32_t> PB;         // [kBf16Keys/2][Rp] probability pairs (keys 2p, 2p+1) per row
  std::vector<uint32_t> zero_key;   // [D/2] the key read for the slots of a partial 8-key block
  std::vector<const c10::BFloat16*> q_rows;  // [rows] the item's query rows (row r: token r / G, head r % G)
  std::vector<c10::BFloat16*> out_rows;      // [rows] where they go
  PrefillBf16Scratch(int64_t D_, int64_t Rp_)
      : PrefillScratch(D_, Rp_), QB(D_ / 2 * Rp_), VB(kBf16Keys / 2 * D_), PB(kBf16Keys / 2 * Rp_),
        zero_key(D_ / 2, 0u), q_rows(Rp_), out_rows(Rp_) {
    ST.assign(kBf16Keys * Rp_, 0.f);
  }
};

inline BF16x32 load_pairs(const uint32_t* p) { return bf16x32_load(reinterpret_cast<const c10::BFloat16*>(p)); }

// ST[j0 + j][rv + 16 v] = sum_p key_j pair p . QB[p][rv + 16 v] for 8 keys (kr[j]: their rows as pairs).
template <int NV>
inline void bf16_score_block(const uint32_t* const* kr, const uint32_t* QB, float* ST, int64_t P, int64_t Rp,
                             int64_t j0, int64_t rv) {
  VecF acc[8][NV];
  for (int j = 0; j < 8; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = vzero();
  for (int64_t p = 0; p < P; ++p) {
    BF16x32 q[NV];
    for (int v = 0; v < NV; ++v) q[v] = load_pairs(QB + p * Rp + rv + v * kLanes);
    for (int j = 0; j < 8; ++j) {
      const BF16x32 k = bf16x32_set1_pair(kr[j][p]);
      for (int v = 0; v < NV; ++v) acc[j][v] = vdot_bf16(acc[j][v], k, q[v]);
    }
  }
  for (int j = 0; j < 8; ++j)
    for (int v = 0; v < NV; ++v) vstore(ST + (j0 + j) * Rp + rv + v * kLanes, acc[j][v]);
}

// OT[d0 + d][rows] = corr * OT[d0 + d][rows] + sum_{p < np} VB[p][d0 + d] . PB[p][rows] for 8 dims and the
// NV row vectors at rv (the softmax's rescale folded into the accumulator's load).
template <int NV>
inline void bf16_pv_block(const uint32_t* VB, const uint32_t* PB, const float* corr, float* OT, int64_t D,
                          int64_t Rp, int64_t np, int64_t d0, int64_t rv) {
  VecF c[NV], acc[8][NV];
  for (int v = 0; v < NV; ++v) c[v] = vload(corr + rv + v * kLanes);
  for (int d = 0; d < 8; ++d)
    for (int v = 0; v < NV; ++v) acc[d][v] = vmul(vload(OT + (d0 + d) * Rp + rv + v * kLanes), c[v]);
  for (int64_t p = 0; p < np; ++p) {
    BF16x32 pr[NV];
    for (int v = 0; v < NV; ++v) pr[v] = load_pairs(PB + p * Rp + rv + v * kLanes);
    for (int d = 0; d < 8; ++d) {
      const BF16x32 vb = bf16x32_set1_pair(VB[p * D + d0 + d]);
      for (int v = 0; v < NV; ++v) acc[d][v] = vdot_bf16(acc[d][v], vb, pr[v]);
    }
  }
  for (int d = 0; d < 8; ++d)
    for (int v = 0; v < NV; ++v) vstore(OT + (d0 + d) * Rp + rv + v * kLanes, acc[d][v]);
}

// Calls block(NV, rv) over the Rp rows in blocks of NV row vectors: 8 keys (or dims) x NV vectors of accumulators.
// AVX-512: 3 vectors (48 rows, the usual tile: 24 accumulators + 3 row vectors + 1 broadcast of the 32 zmm), so
// each broadcast feeds 3 vdpbf16ps and no block is left with only 8 accumulator chains (too few to hide the
// latency); 2 and 1 for the rest. AVX2 (VecF = two ymm, 16 registers) keeps 2 + 1: 3 would spill. Each
// accumulator sums the same products in the same order whatever NV is, so the bits do not depend on it.
template <typename Block>
__attribute__((always_inline)) inline void bf16_row_blocks(int64_t Rp, const Block& block) {
  int64_t rv = 0;
#ifdef PAGELLM_AVX512
  for (; rv + 3 * kLanes <= Rp; rv += 3 * kLanes) block(std::integral_constant<int, 3>{}, rv);
#endif
  for (; rv + 2 * kLanes <= Rp; rv += 2 * kLanes) block(std::integral_constant<int, 2>{}, rv);
  if (rv < Rp) block(std::integral_constant<int, 1>{}, rv);
}

// softmax_update's online softmax over the step's n keys, its probabilities written as bf16 key pairs PB
// [ceil(n/2)][Rp] (an odd last key's partner 0) instead of back into ST; l adds the rounded probabilities.
inline void bf16_softmax_pack(PrefillBf16Scratch& w, int64_t n, float scale) {
  const VecF sv = vset1(scale);
  const int64_t Rp = w.Rp;
  c10::BFloat16* const bf16 = nullptr;  // vround's target type
  for (int64_t rv = 0; rv < Rp; rv += kLanes) {
    VecF mt = vset1(kNegInf);
    for (int64_t j = 0; j < n; ++j) mt = vmax(mt, vload(w.ST.data() + j * Rp + rv));
    const VecF m_old = vload(w.m.data() + rv);
    const VecF m_new = vmax(m_old, mt);
    VecF sum = vzero();
    for (int64_t j = 0; j < n; j += 2) {
      const VecF p0 = vround(vexp_lowp(vmul(vsub(vload(w.ST.data() + j * Rp + rv), m_new), sv)), bf16);
      const VecF p1 =
          j + 1 < n ? vround(vexp_lowp(vmul(vsub(vload(w.ST.data() + (j + 1) * Rp + rv), m_new), sv)), bf16) : vzero();
      vstore_bf16_pairs(w.PB.data() + j / 2 * Rp + rv, p0, p1);
      sum = vadd(sum, vadd(p0, p1));
    }
    const VecF c = vexp(vmul(vsub(m_old, m_new), sv));
    vstore(w.l.data() + rv, vfma(vload(w.l.data() + rv), c, sum));
    vstore(w.m.data() + rv, m_new);
    vstore(w.corr.data() + rv, c);
  }
}

// QB[p][r] = pair p of query row r (rows past `rows` zero).
inline void prefill_bf16_pack_queries(PrefillBf16Scratch& w, int64_t rows) {
  const int64_t D = w.D, Rp = w.Rp;
  const auto q_row = [&](int64_t r) { return w.q_rows[r]; };
#ifdef __AVX512F__
  for (int64_t r0 = 0; r0 < Rp; r0 += kLanes) {  // per 16 rows x 16 pairs one dword transpose
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const int64_t dims = std::min<int64_t>(32, D - d0);  // 16 or 32 (D is a multiple of 16)
      const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << dims) - 1);
      __m512 x[16];
      for (int64_t i = 0; i < kLanes; ++i)
        x[i] = r0 + i < rows ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(mask, q_row(r0 + i) + d0)) : _mm512_setzero_ps();
      transpose16(x);
      for (int64_t p = 0; p < dims / 2; ++p)
        _mm512_storeu_ps(reinterpret_cast<float*>(w.QB.data() + (d0 / 2 + p) * Rp + r0), x[p]);
    }
  }
#else
  std::fill(w.QB.begin(), w.QB.end(), 0u);
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(q_row(r));
    for (int64_t p = 0; p < D / 2; ++p) w.QB[p * Rp + r] = q[p];
  }
#endif
}

// The step's key rows (kr, 8-key blocks; slots past n read the zero key) and value pairs VB (zero past n).
inline void prefill_bf16_load_kv(const PagedAttnArgs<c10::BFloat16>& a, const PrefillItem& it,
                                 PrefillBf16Scratch& w, int64_t start, int64_t n, const uint32_t** kr) {
  const int64_t D = a.head_dim, n8 = (n + 7) / 8 * 8;
  for (int64_t j = 0; j < n8; ++j)
    kr[j] = j < n ? reinterpret_cast<const uint32_t*>(a.row(a.key_cache, it.seq, start + j, it.head))
                  : w.zero_key.data();
  for (int64_t j = 0; j < n; j += 2) {
    const c10::BFloat16* v0 = a.row(a.value_cache, it.seq, start + j, it.head);
    const c10::BFloat16* v1 = j + 1 < n ? a.row(a.value_cache, it.seq, start + j + 1, it.head) : nullptr;
    for (int64_t d = 0; d < D; d += kLanes)  // exact: the values are bf16 already
      vstore_bf16_pairs(w.VB.data() + j / 2 * D + d, vload(v0 + d), v1 ? vload(v1 + d) : vzero());
  }
}

// out rows = OT^T / l (0 for a row without keys), rounded to bf16.
inline void prefill_bf16_store(const PagedAttnArgs<c10::BFloat16>& a, const PrefillItem& it, PrefillBf16Scratch& w) {
  const int64_t D = a.head_dim, Rp = w.Rp, rows = (it.t1 - it.t0) * a.group();
  const auto out_row = [&](int64_t r) { return w.out_rows[r]; };
#ifdef __AVX512F__
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {  // per 16 rows x 16 dims one transpose
    const __m512 l = _mm512_loadu_ps(w.l.data() + r0);
    const __m512 inv =
        _mm512_maskz_div_ps(_mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.0f), l);
    for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
      __m512 x[16];
      for (int64_t i = 0; i < kLanes; ++i) x[i] = _mm512_mul_ps(_mm512_loadu_ps(w.OT.data() + (d0 + i) * Rp + r0), inv);
      transpose16(x);
      for (int64_t i = 0; i < std::min<int64_t>(kLanes, rows - r0); ++i) vstore(out_row(r0 + i) + d0, VecF{x[i]});
    }
  }
#else
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < D; ++d) w.row[d] = w.OT[d * Rp + r];
    store_row(w.row.data(), out_row(r), D, w.l[r] > 0.f ? 1.0f / w.l[r] : 0.f);
  }
#endif
}

inline void prefill_bf16_item(const PagedAttnArgs<c10::BFloat16>& a, const PrefillItem& it, PrefillBf16Scratch& w) {
  const int64_t G = a.group(), D = a.head_dim, Rp = w.Rp, P = D / 2;
  const auto [q_base, pos_base, p_first, p_last] = prefill_span(a, it);
  const int64_t rows = (it.t1 - it.t0) * G;
  std::fill(w.OT.begin(), w.OT.end(), 0.f);
  std::fill(w.m.begin(), w.m.end(), -1e30f);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  for (int64_t r = 0; r < Rp; ++r)  // padded rows repeat the last token's position
    w.pos[r] = static_cast<float>(pos_base + it.t0 + std::min(r, rows - 1) / G);
  for (int64_t t = it.t0, r = 0; t < it.t1; ++t)  // the rows' addresses once per item (no divisions per row)
    for (int64_t g = 0; g < G; ++g, ++r) {
      w.q_rows[r] = a.q_row(q_base + t, it.head * G + g);
      w.out_rows[r] = a.out_row(q_base + t, it.head * G + g);
    }
  prefill_bf16_pack_queries(w, rows);
  const uint32_t* kr[kBf16Keys];
  for (int64_t start = a.window_begin(p_first); start <= p_last; start += kBf16Keys) {
    const int64_t n = std::min(kBf16Keys, p_last + 1 - start), n8 = (n + 7) / 8 * 8;
    prefill_bf16_load_kv(a, it, w, start, n, kr);
    for (int64_t j0 = 0; j0 < n8; j0 += 8)
      bf16_row_blocks(Rp, [&](auto nv, int64_t rv) {
        bf16_score_block<decltype(nv)::value>(kr + j0, w.QB.data(), w.ST.data(), P, Rp, j0, rv);
      });
    float softmax_scale = a.scale;
    if (a.softcap > 0.f) {
      apply_softcap(w.ST.data(), n * Rp, a.softcap, a.scale);
      softmax_scale = 1.0f;
    }
    const bool boundary = start + n - 1 > p_first || (a.window > 0 && start < a.window_begin(p_last));
    if (boundary) mask_tile(a, w, start, n);
    bf16_softmax_pack(w, n, softmax_scale);
    const int64_t np = (n + 1) / 2;
    for (int64_t d0 = 0; d0 < D; d0 += 8)
      bf16_row_blocks(Rp, [&](auto nv, int64_t rv) {
        bf16_pv_block<decltype(nv)::value>(w.VB.data(), w.PB.data(), w.corr.data(), w.OT.data(), D, Rp, np, d0, rv);
      });
  }
  prefill_bf16_store(a, it, w);
}

// Prefetches (to L2) what an item first reads from memory: its query rows (the qkv projection's output, written
// a few ops earlier: L3 at best; these loads were ~13 % of the kernel's time in a profile at SmolLM2's shapes)
// and the key / value rows of its own tokens (just written by reshape_and_cache; the earlier tokens' rows were
// read by the run's previous tile). Issued for the next tile of a run while the current one computes.
inline void prefill_bf16_prefetch(const PagedAttnArgs<c10::BFloat16>& a, const PrefillItem& it) {
  const int64_t G = a.group(), bytes = a.head_dim * static_cast<int64_t>(sizeof(c10::BFloat16));
  const auto [q_base, pos_base, p_first, p_last] = prefill_span(a, it);
  const auto fetch = [bytes](const c10::BFloat16* row) {
    const char* p = reinterpret_cast<const char*>(row);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
    __builtin_prefetch(p + bytes - 1, 0, 2);  // the last line of a row that does not start on a line
  };
  for (int64_t t = it.t0; t < it.t1; ++t) {
    for (int64_t g = 0; g < G; ++g) fetch(a.q_row(q_base + t, it.head * G + g));
    fetch(a.row(a.key_cache, it.seq, pos_base + t, it.head));
    fetch(a.row(a.value_cache, it.seq, pos_base + t, it.head));
  }
}

// A run of consecutive query tiles of one (sequence, kv head), items [begin, end) of prefill_tile_runs' list.
struct PrefillRun {
  int64_t begin, end, cost;
};

// The call's query tiles (~`rows` rows each) in (sequence, kv head, position) order, cut into runs of about
// 1/(8 x threads) of the total cost, most expensive first. A thread runs a run's tiles in order, so each tile
// finds the keys and values of the tiles before it in its own caches (LPT over single tiles interleaves
// sequences and heads: every tile then read its whole context from memory); 8 runs per thread keep the
// dynamic schedule balanced. Returns Rp, as prefill_items.
template <typename T, typename C>
int64_t prefill_tile_runs(const PagedAttnArgs<T, C>& a, std::vector<PrefillItem>& items, std::vector<PrefillRun>& runs,
                          int64_t rows) {
  const int64_t Rp = prefill_items(a, items, rows);
  std::sort(items.begin(), items.end(), [](const PrefillItem& x, const PrefillItem& y) {
    return std::tie(x.seq, x.head, x.t0) < std::tie(y.seq, y.head, y.t0);
  });
  int64_t total = 0;
  for (const PrefillItem& it : items) total += it.cost;
  const int64_t target = std::max<int64_t>(1, total / (8 * std::max<int64_t>(1, num_threads())));
  runs.clear();
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    const PrefillItem& it = items[i];
    const bool same = !runs.empty() && items[i - 1].seq == it.seq && items[i - 1].head == it.head;
    if (same && runs.back().cost + it.cost <= target) {
      runs.back().end = i + 1;
      runs.back().cost += it.cost;
    } else {
      runs.push_back({i, i + 1, it.cost});
    }
  }
  std::stable_sort(runs.begin(), runs.end(), [](const PrefillRun& x, const PrefillRun& y) { return x.cost > y.cost; });
  return Rp;
}

inline void paged_attention_prefill_bf16(const PagedAttnArgs<c10::BFloat16>& a) {
  std::vector<PrefillItem> items;
  std::vector<PrefillRun> runs;
  const int64_t Rp = prefill_tile_runs(a, items, runs, kPrefillBf16Rows);
  const int64_t n_runs = static_cast<int64_t>(runs.size());
  parallel_dynamic(n_runs, [&](auto claim) {
    PrefillBf16Scratch w(a.head_dim, Rp);
    for (int64_t r = claim(); r < n_runs; r = claim())
      for (int64_t i = runs[r].begin; i < runs[r].end; ++i) {
        if (i + 1 < runs[r].end) prefill_bf16_prefetch(a, items[i + 1]);
        prefill_bf16_item(a, items[i], w);
      }
  });
}

#endif  // PAGELLM_BF16_DOT

}  // namespace pagellm::cpu
