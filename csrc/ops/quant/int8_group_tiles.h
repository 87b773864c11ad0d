// int8 x int8 dot products with one activation scale per (row, group of K): the per-token-group activation
// scheme of int8_linear (group_size a multiple of 64, so one 64-byte VNNI step never straddles two groups).
//
// Contract of group_block_<isa>(w, ldw, q, ldq, scale, corr, G, gs, K, mr, nr, acc):
//   w      [nr, K] int8 weight rows (row stride ldw);  q [mr, ldq] int8 activation codes, zero beyond K;
//   scale  [mr, G] fp32 s_ig;  corr [mr, G, 16] the lane corrections of group_lane_corrections (VNNI only);
//   acc    [mr, kInt8NR] fp32: acc[i][j] = sum_g s_ig * (sum_{k in g} q[i][k] w[j][k]).
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

// corr[g * 16 + l] = -128 * (sum of row q's codes in lane l of group g): the VNNI path offsets the signed
// weight by 128 into vpdpbusd's unsigned operand, sum (w + 128) q = sum w q + 128 sum q, and starts each
// group's int32 lanes at this value so that they hold sum w q exactly.
inline void group_lane_corrections(const int8_t* q, int64_t K, int64_t gs, int64_t G, int32_t* corr) {
  std::fill(corr, corr + G * kGroupLanes, 0);
  for (int64_t k = 0; k < K; ++k) corr[(k / gs) * kGroupLanes + (k % 64) / 4] -= 128 * static_cast<int32_t>(q[k]);
}

inline void group_block_scalar(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq, const float* scale,
                               const int32_t* /*corr*/, int64_t G, int64_t gs, int64_t K, int mr, int nr,
                               float* acc) {
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

// One loop over K in 64-byte steps (as dot_tile_vnni), a group flushed at its last step: the accumulators stay
// in registers whatever the group size.
template <int MR, int NR>
PAGELLM_TARGET_VNNI void group_tile_vnni(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq,
                                         const float* scale, const int32_t* corr, int64_t G, int64_t gs, int64_t K,
                                         float* acc_out) {
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
    for (int j = 0; j < NR; ++j) w_raw[j] = _mm512_loadu_si512(w + j * ldw + k);
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
  float lanes[kGroupLanes];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      _mm512_storeu_ps(lanes, facc[i][j]);
      acc_out[i * kInt8NR + j] = reduce16(lanes);
    }
}

template <int NR>
inline void group_rows_vnni(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq, const float* scale,
                            const int32_t* corr, int64_t G, int64_t gs, int64_t K, int mr, float* acc) {
  for (int i0 = 0; i0 < mr; i0 += kGroupMR) {
    const float* s = scale + i0 * G;
    const int32_t* c = corr + i0 * G * kGroupLanes;
    if (mr - i0 >= 2) group_tile_vnni<2, NR>(w, ldw, q + i0 * ldq, ldq, s, c, G, gs, K, acc + i0 * kInt8NR);
    else group_tile_vnni<1, NR>(w, ldw, q + i0 * ldq, ldq, s, c, G, gs, K, acc + i0 * kInt8NR);
  }
}

inline void group_block_vnni(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq, const float* scale,
                             const int32_t* corr, int64_t G, int64_t gs, int64_t K, int mr, int nr, float* acc) {
  if (nr == kInt8NR) return group_rows_vnni<kInt8NR>(w, ldw, q, ldq, scale, corr, G, gs, K, mr, acc);
  for (int j = 0; j < nr; ++j) group_rows_vnni<1>(w + j * ldw, ldw, q, ldq, scale, corr, G, gs, K, mr, acc + j);
}
#endif  // PAGELLM_INT8_X86

}  // namespace pagellm::cpu::int8
