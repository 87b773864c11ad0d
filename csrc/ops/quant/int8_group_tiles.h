// int8 x int8 dot products with one activation scale per (row, group of K): the per-token-group activation
// scheme of int8_linear (group_size a multiple of 64, so one 64-byte VNNI step never straddles two groups).
//
// Contract of group_block_<isa>(w, ldw, q, ldq, scale, corr, G, gs, K, mr, nr, acc, prefetch):
//   w      [nr, K] int8 weight rows (row stride ldw);  q [mr, ldq] int8 activation codes, zero beyond K;
//   scale  [mr, G] fp32 s_ig;  corr [mr, G, 16] the lane corrections of group_lane_corrections_vnni (VNNI only);
//   acc    [mr, kInt8NR] fp32: acc[i][j] = sum_g s_ig * (sum_{k in g} q[i][k] w[j][k]);
//   prefetch: as dot_block's (int8_dot_tiles.h).
// Every path computes it in the same order, so they agree bit for bit: each group's int32 sum is kept per
// 32-bit lane l (the bytes k with (k mod 64) / 4 == l, as vpdpbusd accumulates them), each lane's fp32
// accumulator takes fma(float(lane sum), s_ig, acc_l) group after group, and the 16 lanes are added in the
// tree of `reduce16`.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/quant/int8_dot_tiles.h"

namespace pagellm::cpu::int8 {

constexpr int kGroupLanes = 16;
constexpr int kGroupMR = 2;  // activation rows per VNNI group tile: 2 x 4 fp32 + 2 x 4 int32 accumulators

// The fixed summation tree of the 16 lane accumulators (halves added pairwise: 8, 4, 2, 1).
inline float reduce16(float* v) {
  for (int h = kGroupLanes / 2; h > 0; h /= 2)
    for (int l = 0; l < h; ++l) v[l] = v[l] + v[l + h];
  return v[0];
}

inline void group_block_scalar(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq, const float* scale,
                               const int32_t* /*corr*/, int64_t G, int64_t gs, int64_t K, int mr, int nr,
                               float* acc, bool /*prefetch*/) {
  for (int i = 0; i < mr; ++i) {
    for (int j = 0; j < nr; ++j) {
      const int8_t* qi = q + i * ldq;
      const int8_t* wj = w + j * ldw;
      float lanes[kGroupLanes] = {};
      for (int64_t g = 0; g < G; ++g) {
        int32_t part[kGroupLanes] = {};
        const int64_t k1 = std::min(K, (g + 1) * gs);
        for (int64_t k = g * gs; k < k1; ++k) part[(k % 64) / 4] += int32_t{qi[k]} * int32_t{wj[k]};
        const float s = scale[i * G + g];
        for (int l = 0; l < kGroupLanes; ++l) lanes[l] = std::fma(static_cast<float>(part[l]), s, lanes[l]);
      }
      acc[i * kInt8NR + j] = reduce16(lanes);
    }
  }
}

#ifdef PAGELLM_INT8_X86
// One 64-byte step of a group tile: NR weight vectors (offset into vpdpbusd's unsigned operand) against MR
// activation vectors, into the current group's int32 lanes.
template <int MR, int NR>
PAGELLM_TARGET_VNNI __attribute__((always_inline)) inline void group_step_vnni(const __m512i* w_raw, const int8_t* q,
                                                                                int64_t ldq, __m512i (&iacc)[MR][NR]) {
  __m512i wv[NR];
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) wv[j] = _mm512_xor_si512(w_raw[j], _mm512_set1_epi8(static_cast<char>(0x80)));
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    const __m512i xv = _mm512_loadu_si512(q + i * ldq);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) iacc[i][j] = _mm512_dpbusd_epi32(iacc[i][j], wv[j], xv);
  }
}

// The end of group g: its int32 lanes times s_ig into the fp32 lanes; then the next group's lanes start at its
// corrections (when there is one).
template <int MR, int NR>
PAGELLM_TARGET_VNNI __attribute__((always_inline)) inline void group_flush_vnni(
    const float* scale, const int32_t* corr, int64_t G, int64_t g, __m512i (&iacc)[MR][NR], __m512 (&facc)[MR][NR]) {
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    const __m512 s = _mm512_set1_ps(scale[i * G + g]);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) facc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i][j]), s, facc[i][j]);
    if (g + 1 < G) {
      const __m512i c = _mm512_loadu_si512(corr + (i * G + g + 1) * kGroupLanes);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) iacc[i][j] = c;
    }
  }
}

// The lane tree of reduce16 on a vector: the upper 8 lanes onto the lower 8, then 4, 2, 1 (the same additions,
// so the same bits).
PAGELLM_TARGET_VNNI __attribute__((always_inline)) inline float reduce16_vnni(__m512 v) {
  const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

template <int MR, int NR>
PAGELLM_TARGET_VNNI __attribute__((always_inline)) inline void group_store_vnni(const __m512 (&facc)[MR][NR],
                                                                                 float* acc_out) {
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc_out[i * kInt8NR + j] = reduce16_vnni(facc[i][j]);
}

// Groups of one 64-byte step (the default group_size 64): every step is a whole group, so its int32 lanes
// start at the group's corrections, take one vpdpbusd and go straight into the fp32 lanes; no step count.
template <int MR, int NR>
PAGELLM_TARGET_VNNI void group64_tile_vnni(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq,
                                           const float* scale, const int32_t* corr, int64_t G, int64_t K,
                                           float* acc_out, bool prefetch) {
  __m512 facc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) facc[i][j] = _mm512_setzero_ps();
  __m512i w_raw[NR];
  for (int64_t k = 0, g = 0; g < G; k += 64, ++g) {
    if (k + 64 <= K) {
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        if (prefetch) __builtin_prefetch(w + (j + kInt8PrefetchRows) * ldw + k, 0, 3);
        w_raw[j] = _mm512_loadu_si512(w + j * ldw + k);
      }
    } else {  // masked weight load (never past the row); q is zero there, so the lanes add 0
      const __mmask64 mask = (~0ULL) >> (64 - (K - k));
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) w_raw[j] = _mm512_maskz_loadu_epi8(mask, w + j * ldw + k);
    }
    __m512i iacc[MR][NR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m512i c = _mm512_loadu_si512(corr + (i * G + g) * kGroupLanes);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) iacc[i][j] = c;
    }
    group_step_vnni<MR, NR>(w_raw, q + k, ldq, iacc);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m512 s = _mm512_set1_ps(scale[i * G + g]);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) facc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i][j]), s, facc[i][j]);
    }
  }
  group_store_vnni<MR, NR>(facc, acc_out);
}

// Any group size: one loop over K in 64-byte steps (as dot_tile_vnni), a group flushed at its last step: the
// accumulators stay in registers whatever the group size.
template <int MR, int NR>
PAGELLM_TARGET_VNNI void group_tile_vnni(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq,
                                         const float* scale, const int32_t* corr, int64_t G, int64_t gs, int64_t K,
                                         float* acc_out, bool prefetch) {
  if (gs == 64) return group64_tile_vnni<MR, NR>(w, ldw, q, ldq, scale, corr, G, K, acc_out, prefetch);
  __m512 facc[MR][NR];
  __m512i iacc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    const __m512i c = _mm512_loadu_si512(corr + i * G * kGroupLanes);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) facc[i][j] = _mm512_setzero_ps(), iacc[i][j] = c;
  }
  const int64_t steps_per_group = gs / 64;
  int64_t g = 0, step = 0, k = 0;
  __m512i w_raw[NR];
  for (; k + 64 <= K; k += 64) {
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      if (prefetch) __builtin_prefetch(w + (j + kInt8PrefetchRows) * ldw + k, 0, 3);
      w_raw[j] = _mm512_loadu_si512(w + j * ldw + k);
    }
    group_step_vnni<MR, NR>(w_raw, q + k, ldq, iacc);
    if (++step == steps_per_group) {
      group_flush_vnni<MR, NR>(scale, corr, G, g++, iacc, facc);
      step = 0;
    }
  }
  if (k < K) {  // masked weight load (never past the row); q is zero there, so the lanes add 0
    const __mmask64 mask = (~0ULL) >> (64 - (K - k));
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) w_raw[j] = _mm512_maskz_loadu_epi8(mask, w + j * ldw + k);
    group_step_vnni<MR, NR>(w_raw, q + k, ldq, iacc);
  }
  if (g < G) group_flush_vnni<MR, NR>(scale, corr, G, g, iacc, facc);  // a last group shorter than gs
  group_store_vnni<MR, NR>(facc, acc_out);
}

// corr[g * 16 + l] = -128 * (sum of row q's codes in lane l of group g): the VNNI path offsets the signed
// weight by 128 into vpdpbusd's unsigned operand, sum (w + 128) q = sum w q + 128 sum q, and starts each
// group's int32 lanes at this value so that they hold sum w q exactly. A step's lane sums of q are one
// vpdpbusd against ones. q [ldq] is zero beyond K.
PAGELLM_TARGET_VNNI inline void group_lane_corrections_vnni(const int8_t* q, int64_t K, int64_t gs, int64_t G,
                                                            int32_t* corr) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t g = 0; g < G; ++g) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = g * gs; k < std::min(K, (g + 1) * gs); k += 64)
      sum = _mm512_dpbusd_epi32(sum, ones, _mm512_loadu_si512(q + k));
    _mm512_storeu_si512(corr + g * kGroupLanes, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7)));
  }
}

template <int NR>
inline void group_rows_vnni(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq, const float* scale,
                            const int32_t* corr, int64_t G, int64_t gs, int64_t K, int mr, float* acc, bool prefetch) {
  for (int i0 = 0; i0 < mr; i0 += kGroupMR) {
    const float* s = scale + i0 * G;
    const int32_t* c = corr + i0 * G * kGroupLanes;
    const bool pf = prefetch && i0 == 0;  // the next pairs of x rows find the weight rows in L1
    if (mr - i0 >= 2) group_tile_vnni<2, NR>(w, ldw, q + i0 * ldq, ldq, s, c, G, gs, K, acc + i0 * kInt8NR, pf);
    else group_tile_vnni<1, NR>(w, ldw, q + i0 * ldq, ldq, s, c, G, gs, K, acc + i0 * kInt8NR, pf);
  }
}

inline void group_block_vnni(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq, const float* scale,
                             const int32_t* corr, int64_t G, int64_t gs, int64_t K, int mr, int nr, float* acc,
                             bool prefetch) {
  // One x row (decode): the weight rows one after another, a single sequential stream each, which memory
  // serves faster than four rows side by side (~0.85x the time at M = 1); x is in L1 either way.
  if (nr == kInt8NR && mr > 1)
    return group_rows_vnni<kInt8NR>(w, ldw, q, ldq, scale, corr, G, gs, K, mr, acc, prefetch);
  for (int j = 0; j < nr; ++j)
    group_rows_vnni<1>(w + j * ldw, ldw, q, ldq, scale, corr, G, gs, K, mr, acc + j, prefetch);
}
#endif  // PAGELLM_INT8_X86

}  // namespace pagellm::cpu::int8
