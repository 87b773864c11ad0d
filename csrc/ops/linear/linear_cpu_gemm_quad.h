// The quad tile of the many-row bf16 linear (AVX-512 only): 12 x rows x 2 weight rows per register tile whose
// horizontal sums cost a third of the 6 x 4 tile's, with every element's bits unchanged.
//
// Why: at K = 576 a 6 x 4 tile spends ~70 shuffle / add ops reducing its 24 accumulators (vsum's tree) against
// 432 vdpbf16ps, and that epilogue was ~9 % of the GEMM's time. vsum's first two levels add lane i to lane
// i + 8, then to lane i + 4: lanes that sit in different 128-bit quarters. Here the quarters are separated
// before the dot products instead of after: x is packed in quads of rows, vector j of a 32-element K chunk
// holding quarter j (elements 8j..8j+7) of the four rows side by side, and the weight row's quarter j is
// broadcast to all four 128-bit lanes. Accumulator V_j then holds, in lane 4r + i, exactly what the one-row
// kernel's accumulator for row r holds in lane 4j + i (same operand pairs, same K order, same tail zeros), so
// the first two levels of vsum become vertical adds, (V_0 + V_2) + (V_1 + V_3), and only the last two levels
// (within 128-bit lanes) need shuffles. Same sums, same pairings: bit-identical to the one-row kernel.
#pragma once

#include "ops/linear/linear_cpu_kernels.h"

#if defined(PAGELLM_LINEAR_DPBF16) && defined(PAGELLM_AVX512)
#define PAGELLM_GEMM_QUAD 1
#include <cstdint>
#include <cstring>
#include <memory>

namespace pagellm::cpu {

constexpr int kQuadTileQuads = 3;  // 3 quads (12 rows) x 2 weight rows: 24 accumulators, 3 x + 1 weight registers

// Elements of one packed quad: 4 rows x K rounded up to 32 (the tail chunk zero-filled as the masked loads do).
inline int64_t quad_stride(int64_t K) { return (K + 31) / 32 * 128; }

// One 32-element K chunk of four rows (v[r]) stored as the quad layout's four vectors: a 4 x 4 transpose of
// 128-bit blocks, vector j = (row 0 quarter j, row 1 quarter j, row 2 ..., row 3 ...).
inline void store_quad_chunk(c10::BFloat16* dst, const __m512i v[4]) {
  const __m512i t0 = _mm512_shuffle_i64x2(v[0], v[1], 0x44), t1 = _mm512_shuffle_i64x2(v[0], v[1], 0xEE);
  const __m512i t2 = _mm512_shuffle_i64x2(v[2], v[3], 0x44), t3 = _mm512_shuffle_i64x2(v[2], v[3], 0xEE);
  _mm512_storeu_si512(dst + 0, _mm512_shuffle_i64x2(t0, t2, 0x88));
  _mm512_storeu_si512(dst + 32, _mm512_shuffle_i64x2(t0, t2, 0xDD));
  _mm512_storeu_si512(dst + 64, _mm512_shuffle_i64x2(t1, t3, 0x88));
  _mm512_storeu_si512(dst + 96, _mm512_shuffle_i64x2(t1, t3, 0xDD));
}

// The calling thread's buffer for packed quads (grown, never shrunk; 64-byte aligned), one per Tag type so that
// the GEMM's remembered (call, block) packing and the few-row path never share a buffer.
template <class Tag>
inline c10::BFloat16* quad_scratch(int64_t elems) {
  thread_local std::unique_ptr<c10::BFloat16[]> buf;
  thread_local int64_t cap = 0;
  if (cap < elems) {
    buf.reset(new c10::BFloat16[elems + 32]);
    cap = elems;
  }
  const auto p = reinterpret_cast<uintptr_t>(buf.get());
  return reinterpret_cast<c10::BFloat16*>((p + 63) & ~uintptr_t{63});
}

// xp[quad q][chunk t][quarter j][row r][8] = x[m0 + 4q + r][32t + 8j + e] (0 past K), rows [m0, m0 + 4 * num_quads).
inline void gemm_pack_quads(c10::BFloat16* xp, const c10::BFloat16* x, const LinearArgs& a, int64_t m0,
                            int64_t num_quads) {
  const int64_t nt = (a.K + 31) / 32;
  for (int64_t q = 0; q < num_quads; ++q) {
    const c10::BFloat16* r = x + (m0 + 4 * q) * a.ldx;
    c10::BFloat16* dst = xp + q * quad_stride(a.K);
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t k = 32 * t;
      __m512i v[4];
      for (int i = 0; i < 4; ++i) v[i] = (__m512i)bf16x32_load(r + i * a.ldx + k, a.K - k).v;
      store_quad_chunk(dst + t * 128, v);
    }
  }
}

// Quarter j of a weight row's chunk at k broadcast to the four 128-bit lanes; `left` elements remain in K.
inline BF16x32 quad_weight_quarter(const c10::BFloat16* w, int64_t left) {
  if (left >= 8) return {(__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)))};
  const __mmask8 m = left <= 0 ? 0 : static_cast<__mmask8>((1u << left) - 1u);
  return {(__m512bh)_mm512_broadcast_i32x4(_mm_maskz_loadu_epi16(m, w))};
}

// Sums in lanes 4L + c (c = 0..3: the 4 vectors' row L, in vsum's last two levels), permuted by `order`,
// + bias (b0, b1 alternating), rounded like c10::BFloat16 and stored as `rows` rows of 2 outputs.
inline void quad_store_rows(c10::BFloat16* out, __m512 v, __m512i order, const float* bias2, const LinearArgs& a,
                            int64_t m0, int64_t n0, int rows) {
  v = _mm512_permutexvar_ps(order, v);
  if (bias2) {
    double b01;
    std::memcpy(&b01, bias2, sizeof(b01));
    v = _mm512_add_ps(v, _mm512_castpd_ps(_mm512_set1_pd(b01)));
  }
  alignas(32) uint32_t h[8];  // row i's 2 bf16 values
  _mm256_store_si256(reinterpret_cast<__m256i*>(h), round_bf16_like_c10(v));
  for (int i = 0; i < rows; ++i) std::memcpy(out + (m0 + i) * a.ldo + n0, &h[i], sizeof(uint32_t));
}

// Per 128-bit lane: (a0 + a2, a1 + a3, b0 + b2, b1 + b3), vsum's third level on two vectors.
inline __m512 quad_level3(__m512 a, __m512 b) {
  const __m512d da = _mm512_castps_pd(a), db = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(da, db)), _mm512_castpd_ps(_mm512_unpackhi_pd(da, db)));
}

// Rows [m0, m0 + 4Q) (packed quads at xq) x weight rows n0, n0 + 1.
template <int Q>
__attribute__((always_inline)) inline void gemm_quad_tile(c10::BFloat16* out, const c10::BFloat16* xq, const c10::BFloat16* w, const float* bias2,
                           const LinearArgs& a, int64_t m0, int64_t n0, bool prefetch) {
  static_assert(Q >= 1 && Q <= kQuadTileQuads, "24 accumulators at most");
  __m512 acc[4][Q][2];
  _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j)
    _Pragma("GCC unroll 3") for (int q = 0; q < Q; ++q) acc[j][q][0] = acc[j][q][1] = _mm512_setzero_ps();
  const c10::BFloat16* w0 = w + n0 * a.ldw;
  const c10::BFloat16* w1 = w0 + a.ldw;
  const int64_t qs = quad_stride(a.K), pf = prefetch ? kLinearPrefetchRows * a.ldw : 0;
  const auto chunk = [&](int64_t k, const c10::BFloat16* xt, bool tail) __attribute__((always_inline)) {
    if (pf) {
      __builtin_prefetch(w0 + k + pf, 0, 3);
      __builtin_prefetch(w1 + k + pf, 0, 3);
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {
      __m512bh xv[Q];
      _Pragma("GCC unroll 3") for (int q = 0; q < Q; ++q)
        xv[q] = (__m512bh)_mm512_loadu_si512(xt + q * qs + 32 * j);
      const BF16x32 wa = tail ? quad_weight_quarter(w0 + k + 8 * j, a.K - k - 8 * j) : quad_weight_quarter(w0 + k + 8 * j, 8);
      const BF16x32 wb = tail ? quad_weight_quarter(w1 + k + 8 * j, a.K - k - 8 * j) : quad_weight_quarter(w1 + k + 8 * j, 8);
      _Pragma("GCC unroll 3") for (int q = 0; q < Q; ++q) {
        acc[j][q][0] = vdot_bf16({acc[j][q][0]}, wa, {xv[q]}).v;
        acc[j][q][1] = vdot_bf16({acc[j][q][1]}, wb, {xv[q]}).v;
      }
    }
  };
  int64_t k = 0;
  for (; k + 32 <= a.K; k += 32) chunk(k, xq + k * 4, false);
  if (k < a.K) chunk(k, xq + k * 4, true);
  // vsum's levels 1 and 2 as vertical adds: lane 4r + i of y = row r's partial i after level 2.
  __m512 y[Q][2];
  _Pragma("GCC unroll 3") for (int q = 0; q < Q; ++q)
    for (int n = 0; n < 2; ++n)
      y[q][n] = _mm512_add_ps(_mm512_add_ps(acc[0][q][n], acc[2][q][n]), _mm512_add_ps(acc[1][q][n], acc[3][q][n]));
  // Levels 3 and 4 within 128-bit lanes; then lane 4L + c holds (quad, weight) c's row L.
  const __m512i order8 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  int q = 0;
  for (; q + 2 <= Q; q += 2) {  // 8 rows: c = (q, n0), (q, n1), (q + 1, n0), (q + 1, n1)
    const __m512 z0 = quad_level3(y[q][0], y[q][1]), z1 = quad_level3(y[q + 1][0], y[q + 1][1]);
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, 0x88), _mm512_shuffle_ps(z0, z1, 0xDD));
    quad_store_rows(out, s, order8, bias2, a, m0 + 4 * q, n0, 8);
  }
  if (q < Q) {  // 4 rows: c = (q, n0), (q, n1) (lanes 2, 3 repeat them)
    const __m512 z = quad_level3(y[q][0], y[q][1]);
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(z, z, 0x88), _mm512_shuffle_ps(z, z, 0xDD));
    quad_store_rows(out, s, order8, bias2, a, m0 + 4 * q, n0, 4);
  }
}

}  // namespace pagellm::cpu
#endif
