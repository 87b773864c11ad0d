// Paged attention for decode (one query token per sequence), flash-decoding style.
//
// Work item = (sequence, kv head, context partition). Each item loads the group of G query heads that
// share the kv head, then streams the partition's keys/values ONCE in tiles of kTile tokens: scores for
// all G heads, an online-softmax update (fp32), and a V accumulation held in registers per 16-lane
// column block. With one partition per sequence the item writes the output directly; otherwise it
// writes (acc, max, sum) partials that decode_reduce merges. Memory-bound: every cache byte read once.
// Quantized caches (int8 / fp8): rows are converted to fp32 in registers as they are used; a key row's scale
// multiplies its score (q . k_j = scale_j * (q . stored_j)) and a value row's scale multiplies its probability
// after the softmax sums, so the fp32 accumulation and the online softmax are those of a float cache.
#pragma once

#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops/paged_attention/attention_cpu_common.h"
#include "ops/paged_attention/decode_bf16_pv.h"

namespace pagellm::cpu {

constexpr int64_t kDecodeTile = 32;

// sc[g * kDecodeTile + j] = q_g . k_j for heads g0..g0+GN (q pre-scaled, fp32). Two keys per pass
// give 2*GN independent FMA chains (latency hiding); each key row is converted once for all heads.
template <int GN, typename T>
inline void decode_scores(const float* qf, const T* const* kp, int64_t n, int64_t D, int64_t g0, float* sc,
                          const void* const* pf) {
  const int64_t rb = D * static_cast<int64_t>(sizeof(T));
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    prefetch_bytes(pf[2 * j], rb);
    prefetch_bytes(pf[2 * j + 1], rb);
    prefetch_bytes(pf[2 * j + 2], rb);
    prefetch_bytes(pf[2 * j + 3], rb);
    VecF a0[GN], a1[GN];
    for (int g = 0; g < GN; ++g) a0[g] = a1[g] = vzero();
    for (int64_t d = 0; d < D; d += kLanes) {
      const VecF k0 = vload(kp[j] + d), k1 = vload(kp[j + 1] + d);
      for (int g = 0; g < GN; ++g) {
        const VecF q = vload(qf + (g0 + g) * D + d);
        a0[g] = vfma(k0, q, a0[g]);
        a1[g] = vfma(k1, q, a1[g]);
      }
    }
    for (int g = 0; g < GN; ++g) {
      sc[(g0 + g) * kDecodeTile + j] = vsum(a0[g]);
      sc[(g0 + g) * kDecodeTile + j + 1] = vsum(a1[g]);
    }
  }
  for (; j < n; ++j) {
    prefetch_bytes(pf[2 * j], rb);
    prefetch_bytes(pf[2 * j + 1], rb);
    VecF acc[GN];
    for (int g = 0; g < GN; ++g) acc[g] = vzero();
    for (int64_t d = 0; d < D; d += kLanes) {
      const VecF k = vload(kp[j] + d);
      for (int g = 0; g < GN; ++g) acc[g] = vfma(k, vload(qf + (g0 + g) * D + d), acc[g]);
    }
    for (int g = 0; g < GN; ++g) sc[(g0 + g) * kDecodeTile + j] = vsum(acc[g]);
  }
}

#ifdef PAGELLM_BF16_DOT  // vdpbf16ps, or its exact AVX2 emulation (cpu_vec_avx2.h)
#define PAGELLM_DECODE_BF16_DOT 1
// bf16 x bf16 -> fp32 pair dot products (vdpbf16ps, 32 elements per instruction): no conversions. q: the raw
// (unscaled) bf16 queries of X heads. Score (x, j) = scale * vsum16-lane of the 16 partial sums of q_x . k_j
// (vdpbf16ps over d in steps of 32 from zero): one head's 16 keys at a time keep their accumulators in registers
// and meet the transposing add tree there, so nothing goes through memory but the 16 scores (the key rows come
// from L1 again for the other heads). kp: n rows, then at least up to the next multiple of 16 any valid rows
// (their lanes are computed and dropped). While head 0 runs, the next tile's rows pf[0 .. 2 * kDecodeTile) are
// prefetched, four per key.
inline void decode_scores_bf16(const c10::BFloat16* qb, const c10::BFloat16* const* kp, int64_t n, int64_t D,
                               int64_t X, float scale, float* sc, const void* const* pf) {
  const int64_t rb = D * 2;
  const VecF sv = vset1(scale);
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const int nk = static_cast<int>(std::min<int64_t>(kLanes, n - j0));
    // The prefetches of the 16-key group (and, when this is the tile's only group, of the second one too).
    const int64_t pf_keys = n <= kLanes ? 2 * kLanes : kLanes;
    for (int64_t x = 0; x < X; ++x) {
      VecF acc[kLanes];
      for (int i = 0; i < kLanes; ++i) acc[i] = vzero();
      for (int64_t d = 0; d < D; d += 32) {
        const BF16x32 q = bf16x32_load(qb + x * D + d, D - d);
        for (int i = 0; i < kLanes; ++i) acc[i] = vdot_bf16(acc[i], bf16x32_load(kp[j0 + i] + d, D - d), q);
      }
      if (x == 0) {
        for (int64_t i = 0; i < pf_keys; i += kLanes) {
          for (int e = 0; e < 2 * kLanes; ++e) prefetch_bytes(pf[2 * (j0 + i) + e], rb);
        }
      }
      const VecF scores = vmul(vsum16(acc), sv);
      if (nk == kLanes) {
        vstore(sc + x * kDecodeTile + j0, scores);  // a plain store: the softmax's loads forward from it
      } else {
        vstore(sc + x * kDecodeTile + j0, scores, nk);
      }
    }
  }
}
#endif

// acc[g, d:d+16*NC] += sum_j p[g, j] * v_j[d:d+16*NC]: NC column blocks at once for NC*GN FMA chains.
template <int GN, int NC, typename T>
inline void decode_accum_cols(float* acc, const float* p, const T* const* vp, int64_t n, int64_t D, int64_t g0,
                              int64_t d) {
  VecF a[NC][GN];
  for (int c = 0; c < NC; ++c)
    for (int g = 0; g < GN; ++g) a[c][g] = vload(acc + (g0 + g) * D + d + c * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    VecF v[NC];
    for (int c = 0; c < NC; ++c) v[c] = vload(vp[j] + d + c * kLanes);
    for (int g = 0; g < GN; ++g) {
      const VecF pj = vset1(p[(g0 + g) * kDecodeTile + j]);
      for (int c = 0; c < NC; ++c) a[c][g] = vfma(pj, v[c], a[c][g]);
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int g = 0; g < GN; ++g) vstore(acc + (g0 + g) * D + d + c * kLanes, a[c][g]);
}

// acc[g, :] += sum_j p[g, j] * v_j for heads g0..g0+GN (registers: NC*GN accumulators, <= 16).
template <int GN, typename T>
inline void decode_accum(float* acc, const float* p, const T* const* vp, int64_t n, int64_t D, int64_t g0) {
  constexpr int NC = GN <= 4 ? 4 : (GN <= 8 ? 2 : 1);
  int64_t d = 0;
  for (; d + NC * kLanes <= D; d += NC * kLanes) decode_accum_cols<GN, NC>(acc, p, vp, n, D, g0, d);
  for (; d < D; d += kLanes) decode_accum_cols<GN, 1>(acc, p, vp, n, D, g0, d);
}

// Dispatches a head-group kernel in register-sized chunks of at most 8 heads.
template <template <int> class K, typename... Args>
inline void for_head_chunks(int64_t G, Args&&... args) {
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    switch (std::min<int64_t>(8, G - g0)) {
      case 1: K<1>::run(g0, args...); break;
      case 2: K<2>::run(g0, args...); break;
      case 3: K<3>::run(g0, args...); break;
      case 4: K<4>::run(g0, args...); break;
      case 5: K<5>::run(g0, args...); break;
      case 6: K<6>::run(g0, args...); break;
      case 7: K<7>::run(g0, args...); break;
      default: K<8>::run(g0, args...); break;
    }
  }
}

template <int GN>
struct ScoresK {
  template <typename T>
  static void run(int64_t g0, const float* qf, const T* const* kp, int64_t n, int64_t D, float* sc,
                  const void* const* pf) {
    decode_scores<GN>(qf, kp, n, D, g0, sc, pf);
  }
};
template <int GN>
struct AccumK {
  template <typename T>
  static void run(int64_t g0, float* acc, const float* p, const T* const* vp, int64_t n, int64_t D) {
    decode_accum<GN>(acc, p, vp, n, D, g0);
  }
};

// Online softmax on one head's tile scores (in place -> probabilities); returns the rescale factor.
inline float softmax_update(float* s, int64_t n, float& m, float& l) {
  float corr;
  const float m_new = running_max_update(s, n, m, corr);
  const VecF mv = vset1(m_new);
  VecF sum = vzero();
  for (int64_t j = 0; j < n; j += kLanes) {
    const int c = static_cast<int>(std::min<int64_t>(kLanes, n - j));
    const VecF e = vexp(vsub(vload(s + j, c), mv));
    vstore(s + j, e, c);
    // lanes >= c as 0 (what a masked reload of s + j gave, without waiting for the masked store to retire)
    sum = vadd(sum, c == kLanes ? e : vselect_lt(vload(kLaneIndex), vset1(static_cast<float>(c)), e, vzero()));
  }
  l = l * corr + vsum(sum);
  m = m_new;
  return corr;
}

// Whether a call's tiles take the bf16 P.V (bf16 queries and cache, head_dim a multiple of 32: the zipped value
// rows are whole 32-value loads); decode_softmax and decode_tile_accum must agree on it.
template <typename T, typename C>
inline bool use_bf16_pv(const PagedAttnArgs<T, C>& a) {
#ifdef PAGELLM_DECODE_BF16_DOT
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>) return a.head_dim % 32 == 0;
#endif
  (void)a;
  return false;
}

// The online softmax update of one head's tile scores (in place -> probabilities); returns the rescale factor.
template <typename T, typename C>
inline float decode_softmax(const PagedAttnArgs<T, C>& a, float* s, int64_t n, float& m, float& l) {
#ifdef PAGELLM_DECODE_BF16_DOT
  if (use_bf16_pv(a)) return softmax_update_bf16(s, n, m, l);
#endif
  return softmax_update(s, n, m, l);
}

// acc[x, :] += sum_j p[x, j] * v_j for the X heads of p (rows kDecodeTile apart), with decode_softmax's p.
template <typename T, typename C>
inline void decode_tile_accum(const PagedAttnArgs<T, C>& a, int64_t X, float* acc, const float* p,
                              const C* const* vp, int64_t n) {
#ifdef PAGELLM_DECODE_BF16_DOT
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    if (use_bf16_pv(a)) return for_head_chunks<AccumBf16K>(X, acc, p, vp, n, a.head_dim, kDecodeTile);
  }
#endif
  for_head_chunks<AccumK>(X, acc, p, vp, n, a.head_dim);
}

struct DecodeScratch {
  std::vector<float> qf, sc, ks, vs;  // ks, vs: the tile's key / value row scales (quantized caches)
  std::vector<c10::BFloat16> qb;
  std::vector<const void*> kp, vp;
  // Rows of the NEXT tile, interleaved (k0, v0, k1, v1, ...; 2 spare entries for an odd pair), prefetched
  // a key pair at a time from inside the score loop so the prefetches overlap compute.
  std::vector<const void*> pf;
  DecodeScratch(int64_t G, int64_t D)
      : qf(G * D), sc(G * kDecodeTile), ks(kDecodeTile), vs(kDecodeTile), qb(G * D),
        kp(kDecodeTile), vp(kDecodeTile),
        pf(2 * kDecodeTile + 2) {}
};

template <typename T, typename C>
constexpr bool use_bf16_dot() {
#ifdef PAGELLM_DECODE_BF16_DOT
  return std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
#else
  return false;
#endif
}

template <typename T, typename C>
inline void decode_tile_scores(const PagedAttnArgs<T, C>& a, DecodeScratch& w, const C* const* kp, int64_t n) {
#ifdef PAGELLM_DECODE_BF16_DOT
  if constexpr (use_bf16_dot<T, C>()) {
    decode_scores_bf16(w.qb.data(), reinterpret_cast<const c10::BFloat16* const*>(kp), n, a.head_dim, a.group(),
                       a.scale, w.sc.data(), static_cast<const void* const*>(w.pf.data()));
    return;
  }
#endif
  for_head_chunks<ScoresK>(a.group(), static_cast<const float*>(w.qf.data()), kp, n, a.head_dim, w.sc.data(),
                           static_cast<const void* const*>(w.pf.data()));
  if constexpr (PagedAttnArgs<T, C>::kQuantized) {
    for (int64_t g = 0; g < a.group(); ++g) mul_elementwise(w.sc.data() + g * kDecodeTile, w.ks.data(), n);
  }
}

// Where a query's keys sit when they are not the positions 0, 1, 2, ...: key k >= begin is the cache position
// pos[k - begin] (tree attention: a candidate's ancestors, in lookahead slots with gaps). Plain decode: none.
struct DecodeKeyTail {
  int64_t begin = std::numeric_limits<int64_t>::max();
  const int32_t* pos = nullptr;
};

// Rows (and, quantized, scales) of keys [start, start + n) into kp / vp / ks / vs; kp[n ..) = kp[0].
template <typename T, typename C>
inline void decode_tile_rows(const PagedAttnArgs<T, C>& a, int64_t s, int64_t h, int64_t start, int64_t n,
                             DecodeScratch& w, const C** kp, const C** vp, const DecodeKeyTail& tail) {
  const int64_t D = a.head_dim;
  for (int64_t j = 0; j < n;) {
    const int64_t p = start + j;
    int64_t idx, run = 1;
    if (p >= tail.begin) {
      idx = a.row_index(s, tail.pos[p - tail.begin], h);
    } else {  // the rest of p's block (rows are consecutive there), up to the tile's or the tail's first key
      idx = a.row_index(s, p, h);
      run = std::min({n - j, a.block_size - (p & (a.block_size - 1)), tail.begin - p});
    }
    const C* k = a.key_cache + idx * D;
    const C* v = a.value_cache + idx * D;
    for (int64_t r = 0; r < run; ++r) {
      kp[j + r] = k + r * D;
      vp[j + r] = v + r * D;
      if constexpr (PagedAttnArgs<T, C>::kQuantized) {
        w.ks[j + r] = a.k_scale[idx + r];
        w.vs[j + r] = a.v_scale[idx + r];
      }
    }
    j += run;
  }
  for (int64_t j = n; j < kDecodeTile; ++j) kp[j] = kp[0];  // valid rows for the score loop's whole 16-key groups
}

// The work item a thread takes after the current one (seq < 0: none): its first tile is prefetched while the
// current item's last tile is scored, so a new item does not start on a cold tile (the item's other tiles are
// prefetched one tile ahead from inside the item).
struct DecodeNextItem {
  int64_t seq = -1, h = 0, kbeg = 0, kend = 0;
};

// pf[2j], pf[2j + 1] = key / value rows of keys [start, start + nn) of sequence s, kv head h.
template <typename T, typename C>
inline void decode_prefetch_rows(const PagedAttnArgs<T, C>& a, int64_t s, int64_t h, int64_t start, int64_t nn,
                                 DecodeScratch& w) {
  const int64_t D = a.head_dim;
  for (int64_t j = 0; j < nn;) {
    const int64_t p = start + j;
    const int64_t run = std::min(nn - j, a.block_size - (p & (a.block_size - 1)));
    const C* k = a.row(a.key_cache, s, p, h);
    const C* v = a.row(a.value_cache, s, p, h);
    for (int64_t r = 0; r < run; ++r) {
      w.pf[2 * (j + r)] = k + r * D;
      w.pf[2 * (j + r) + 1] = v + r * D;
    }
    j += run;
  }
}

// Attends keys [kbeg, kend) of sequence s for kv head h; leaves unnormalized acc [G, D], m [G], l [G].
template <typename T, typename C>
void decode_item(const PagedAttnArgs<T, C>& a, int64_t s, int64_t h, int64_t kbeg, int64_t kend, DecodeScratch& w,
                 float* acc, float* m, float* l, const DecodeKeyTail& tail = {}, const DecodeNextItem& next = {}) {
  const int64_t G = a.group(), D = a.head_dim;
  for (int64_t g = 0; g < G; ++g) {
    if constexpr (use_bf16_dot<T, C>()) {
      std::memcpy(w.qb.data() + g * D, a.q_row(s, h * G + g), D * sizeof(T));
    } else {
      load_row_f32(a.q_row(s, h * G + g), w.qf.data() + g * D, D, a.scale);
    }
    m[g] = kNegInf;
    l[g] = 0.f;
  }
  std::fill(acc, acc + G * D, 0.f);
  auto** kp = reinterpret_cast<const C**>(w.kp.data());
  auto** vp = reinterpret_cast<const C**>(w.vp.data());
  for (int64_t start = kbeg; start < kend; start += kDecodeTile) {
    const int64_t n = std::min(kDecodeTile, kend - start);
    decode_tile_rows(a, s, h, start, n, w, kp, vp, tail);
    // Next tile's rows (its blocks are random), prefetched by the score loop; after the last tile: the next work
    // item's first tile, else this tile's rows. (A tail's keys are prefetched at their logical positions: rows of
    // the same sequence, a harmless miss.)
    int64_t nn = std::min(kDecodeTile, kend - start - n);
    if (nn > 0) {
      decode_prefetch_rows(a, s, h, start + n, nn, w);
    } else if (next.seq >= 0) {
      nn = std::min(kDecodeTile, next.kend - next.kbeg);
      decode_prefetch_rows(a, next.seq, next.h, next.kbeg, nn, w);
    }
    for (int64_t j = nn; j < kDecodeTile + 1; ++j) w.pf[2 * j] = w.pf[2 * j + 1] = kp[0];
    decode_tile_scores(a, w, static_cast<const C* const*>(kp), n);
    for (int64_t g = 0; g < G; ++g) {
      float* sg = w.sc.data() + g * kDecodeTile;
      if (a.softcap > 0.f) apply_softcap(sg, n, a.softcap);
      const float corr = decode_softmax(a, sg, n, m[g], l[g]);
      if (corr != 1.0f) store_row(acc + g * D, acc + g * D, D, corr);
      if constexpr (PagedAttnArgs<T, C>::kQuantized) mul_elementwise(sg, w.vs.data(), n);  // after l took p
    }
    decode_tile_accum(a, G, acc, static_cast<const float*>(w.sc.data()), static_cast<const C* const*>(vp), n);
  }
}

// Writes acc / l (0 where l == 0, i.e. an empty context).
template <typename T>
inline void write_normalized(T* dst, const float* acc, float l, int64_t D) {
  store_row(acc, dst, D, l > 0.f ? 1.0f / l : 0.0f);
}

struct DecodePart {
  int64_t seq, kbeg, kend;
};

// Keys per context partition: a constant, so a query's partitions (and with them its rounding: the online
// softmax's tiles and the merge of partials) depend only on its own position, never on how many other
// sequences share the call (batch invariance; speculative verify rows then match plain decode bit for bit).
// 256 is what the old batch-1 rule chose for contexts up to 256 * 4 * threads / kv_heads tokens.
constexpr int64_t kDecodePartition = 256;
static_assert(kDecodePartition % kDecodeTile == 0, "partitions hold whole key tiles");

// Splits each sequence's visible context into partitions of kDecodePartition keys (the last one shorter),
// counted from the first visible key; part_off[s] indexes seq s's parts.
template <typename T, typename C>
std::vector<DecodePart> plan_decode(const PagedAttnArgs<T, C>& a, std::vector<int64_t>& part_off) {
  const int64_t part = kDecodePartition;
  std::vector<DecodePart> parts;
  part_off.assign(a.num_seqs + 1, 0);
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t len = a.seq_lens[s];
    const int64_t beg = a.window_begin(len - 1);
    int64_t k = beg;
    do {
      parts.push_back({s, k, std::min(len, k + part)});
      k += part;
    } while (k < len);
    part_off[s + 1] = static_cast<int64_t>(parts.size());
  }
  return parts;
}

// Merges the partials of (seq, kv head) into the output.
template <typename T, typename C>
void decode_reduce(const PagedAttnArgs<T, C>& a, const std::vector<int64_t>& part_off, const float* partials) {
  const int64_t G = a.group(), D = a.head_dim, H = a.num_kv_heads;
  const int64_t item_floats = G * (D + 2);
  // ~>= 16K partial floats per task: a batch-1 merge (a few KiB) runs inline, since a parallel region of
  // its own cost more than the merge.
  const int64_t parts_per_seq = std::max<int64_t>(1, part_off[a.num_seqs] / std::max<int64_t>(1, a.num_seqs));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / (item_floats * parts_per_seq));
  pagellm::cpu::parallel_for(0, a.num_seqs * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t s = u / H, h = u % H;
      for (int64_t g = 0; g < G; ++g) {
        float M = kNegInf, L = 0.f;
        for (int64_t p = part_off[s]; p < part_off[s + 1]; ++p) M = std::max(M, partials[(p * H + h) * item_floats + G * D + g]);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t p = part_off[s]; p < part_off[s + 1]; ++p) {
          const float* it = partials + (p * H + h) * item_floats;
          if (it[G * D + G + g] == 0.f) continue;  // empty partition
          const float w = std::exp(it[G * D + g] - M);
          L += w * it[G * D + G + g];
          for (int64_t d = 0; d < D; d += kLanes) {
            vstore(acc.data() + d, vfma(vset1(w), vload(it + g * D + d), vload(acc.data() + d)));
          }
        }
        write_normalized(a.out_row(s, h * G + g), acc.data(), L, D);
      }
    }
  });
}

// tails: nullptr, or one DecodeKeyTail per sequence (keys read out of position order).
template <typename T, typename C>
void paged_attention_decode_kernel(const PagedAttnArgs<T, C>& a, const DecodeKeyTail* tails = nullptr) {
  std::vector<int64_t> part_off;
  const std::vector<DecodePart> parts = plan_decode(a, part_off);
  const int64_t G = a.group(), D = a.head_dim, H = a.num_kv_heads;
  const bool split = static_cast<int64_t>(parts.size()) > a.num_seqs;
  const int64_t item_floats = G * (D + 2);
  std::vector<float> partials(split ? parts.size() * H * item_floats : 0);
  const int64_t n_items = static_cast<int64_t>(parts.size()) * H;
  parallel_dynamic(n_items, [&](auto claim) {
    DecodeScratch w(G, D);
    std::vector<float> own(item_floats);
    // Each thread claims one item ahead, so the current item can prefetch the next one's first tile.
    for (int64_t i = claim(), ahead = i < n_items ? claim() : n_items; i < n_items; i = ahead, ahead = claim()) {
      const DecodePart& p = parts[i / H];
      const int64_t h = i % H;
      DecodeNextItem next;
      if (ahead < n_items) {
        const DecodePart& q = parts[ahead / H];
        next = {q.seq, ahead % H, q.kbeg, q.kend};
      }
      float* it = split ? partials.data() + i * item_floats : own.data();
      decode_item(a, p.seq, h, p.kbeg, p.kend, w, it, it + G * D, it + G * D + G,
                  tails != nullptr ? tails[p.seq] : DecodeKeyTail{}, next);
      if (!split) {
        for (int64_t g = 0; g < G; ++g) write_normalized(a.out_row(p.seq, h * G + g), it + g * D, it[G * D + G + g], D);
      }
    }
  });
  if (split) decode_reduce(a, part_off, partials.data());
}

}  // namespace pagellm::cpu
