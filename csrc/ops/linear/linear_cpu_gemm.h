// Many-row bf16 path of linear_small_m (prefill chunks, batched decode): out[M, N] = x[M, K] @ w[N, K]^T.
//
// Every (row, output) element is computed exactly as the one-row kernel computes it (linear_cpu_kernels.h:
// one 16-lane fp32 accumulator over K in steps of 32 with vdpbf16ps, the same masked tail, vsum's reduction
// tree, + bias, one round-to-nearest-even), so results are bit-identical whatever M is (batch invariance).
// What changes is only the schedule: 4 x-rows x 4 weight-rows tiles (16 accumulators, 8 loads per 16
// vdpbf16ps instead of 6 per 8), the 16 horizontal sums done side by side (vsum_each16), and work split
// across threads as (64-row x block, 32-weight-row block) items, so every thread gets a balanced share even
// when N is small (the one-row kernel splits N only, in chunks sized for streaming the weight once).
#pragma once

#include "ops/linear/linear_cpu_kernels.h"

#ifdef PAGELLM_LINEAR_DPBF16
namespace pagellm::cpu {

// out[i] = vsum(v[i]) bit for bit, for 16 vectors at once: vsum's own tree (lanes i + i+8, then i + i+4,
// i + i+2, i + i+1) run on the 16 vectors side by side (15 vector adds instead of 64 scalar-ish steps), then
// one permute into order. Float addition commutes exactly, so only the pairing has to match vsum's.
inline void vsum_each16(const VecF* v, float* out) {
#ifdef PAGELLM_AVX512
  __m512 x[8], y[4];
  for (int p = 0; p < 8; ++p)  // lanes 0-7: v[2p]'s i + i+8; lanes 8-15: v[2p+1]'s
    x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p].v, v[2 * p + 1].v, 0x44),
                         _mm512_shuffle_f32x4(v[2 * p].v, v[2 * p + 1].v, 0xEE));
  for (int p = 0; p < 4; ++p)  // 128-bit lane q: v[4p+q]'s i + i+4
    y[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0xDD));
  const auto pairs = [](__m512 a, __m512 b) {  // per 128-bit lane: (a0+a2, a1+a3, b0+b2, b1+b3)
    const __m512d da = _mm512_castps_pd(a), db = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(da, db)), _mm512_castpd_ps(_mm512_unpackhi_pd(da, db)));
  };
  // 128-bit lane L of z0: (L, 4 + L) as two partials each; of z1: (8 + L, 12 + L)
  const __m512 z0 = pairs(y[0], y[1]), z1 = pairs(y[2], y[3]);
  // lane 4L + j = the sum of v[4j + L]
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, 0x88), _mm512_shuffle_ps(z0, z1, 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, r));
#else
  for (int i = 0; i < 16; ++i) out[i] = vsum(v[i]);
#endif
}

// Rows of M from which linear_small_m takes this path (below it, the weight-streaming schedule is as fast).
constexpr int64_t kLinearGemmMinM = 8;
constexpr int64_t kGemmMBlock = 64, kGemmNBlock = 32;  // a work item: 64 x rows x at most 32 weight rows

// Weight rows per work item: as many as keep ~32 KiB of weight (L1) while 4 x rows sweep them, 4..32.
inline int64_t gemm_n_block(int64_t K) {
  return std::clamp<int64_t>((32 << 10) / (2 * std::max<int64_t>(K, 1)) / 4 * 4, 4, kGemmNBlock);
}

inline void gemm_tile_4x4_bf16(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w,
                               const float* bias4, const LinearArgs& a, int64_t m0, int64_t n0, bool prefetch) {
  VecF acc[16];
  _Pragma("GCC unroll 16")
  for (int i = 0; i < 16; ++i) acc[i] = vzero();
  const c10::BFloat16* xr[4];
  const c10::BFloat16* wr[4];
  _Pragma("GCC unroll 4")
  for (int i = 0; i < 4; ++i) {
    xr[i] = x + (m0 + i) * a.ldx;
    wr[i] = w + (n0 + i) * a.ldw;
  }
  // The first x tile of a block meets its weight rows first (from DRAM for a big LM head): fetch rows ahead.
  const int64_t pf = prefetch ? kLinearPrefetchRows * a.ldw : 0;
  int64_t k = 0;
  for (; k + 32 <= a.K; k += 32) {
    BF16x32 wv[4];
    _Pragma("GCC unroll 4")
    for (int j = 0; j < 4; ++j) {
      if (pf) __builtin_prefetch(wr[j] + k + pf, 0, 3);
      wv[j] = bf16x32_load(wr[j] + k);
    }
    _Pragma("GCC unroll 4")
    for (int i = 0; i < 4; ++i) {
      const BF16x32 xv = bf16x32_load(xr[i] + k);
      _Pragma("GCC unroll 4")
      for (int j = 0; j < 4; ++j) acc[i * 4 + j] = vdot_bf16(acc[i * 4 + j], wv[j], xv);
    }
  }
  if (k < a.K) {
    BF16x32 wv[4];
    _Pragma("GCC unroll 4")
    for (int j = 0; j < 4; ++j) wv[j] = bf16x32_load(wr[j] + k, a.K - k);
    _Pragma("GCC unroll 4")
    for (int i = 0; i < 4; ++i) {
      const BF16x32 xv = bf16x32_load(xr[i] + k, a.K - k);
      _Pragma("GCC unroll 4")
      for (int j = 0; j < 4; ++j) acc[i * 4 + j] = vdot_bf16(acc[i * 4 + j], wv[j], xv);
    }
  }
  alignas(64) float s[16];
  vsum_each16(acc, s);
#ifdef PAGELLM_AVX512
  // + bias and c10::BFloat16's rounding (nearest-even, NaN -> 0x7fc0) on all 16 sums at once, then 4 rows of 4.
  __m512 v = _mm512_load_ps(s);
  if (bias4) v = _mm512_add_ps(v, _mm512_broadcast_f32x4(_mm_loadu_ps(bias4)));
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
  const __m256i h = _mm512_cvtepi32_epi16(r);
  const __m128i h01 = _mm256_castsi256_si128(h), h23 = _mm256_extracti128_si256(h, 1);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out + m0 * a.ldo + n0), h01);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out + (m0 + 1) * a.ldo + n0), _mm_unpackhi_epi64(h01, h01));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out + (m0 + 2) * a.ldo + n0), h23);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out + (m0 + 3) * a.ldo + n0), _mm_unpackhi_epi64(h23, h23));
#else
  _Pragma("GCC unroll 4")
  for (int i = 0; i < 4; ++i) {
    c10::BFloat16* o = out + (m0 + i) * a.ldo + n0;
    _Pragma("GCC unroll 4")
    for (int j = 0; j < 4; ++j) o[j] = c10::BFloat16(bias4 ? s[i * 4 + j] + bias4[j] : s[i * 4 + j]);
  }
#endif
}

// Rows [m0, m1) x weight rows [n0, n1): 4 x 4 tiles, the one-row kernel's tiles on the edges.
inline void gemm_block_bf16(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w,
                            const c10::BFloat16* bias, const LinearArgs& a, int64_t m0, int64_t m1, int64_t n0,
                            int64_t n1) {
  const int64_t n4 = n0 + (n1 - n0) / 4 * 4;
  float b[kGemmNBlock];
  for (int64_t n = n0; n < n4; ++n) b[n - n0] = bias ? static_cast<float>(bias[n]) : 0.f;
  int64_t m = m0;
  // x tile (4 rows) outer, weight tiles inner: the 4 x rows stay in L1 while the block's weight rows pass.
  for (; m + 4 <= m1; m += 4)
    for (int64_t n = n0; n < n4; n += 4)
      gemm_tile_4x4_bf16(out, x, w, bias ? b + (n - n0) : nullptr, a, m, n, m == m0);
  for (; m < m1; ++m)
    for (int64_t n = n0; n < n4; n += 4) linear_tile<1, 4>(out, x, w, bias, a, m, n);
  for (int64_t n = n4; n < n1; ++n)
    for (int64_t mm = m0; mm < m1; ++mm) linear_tile<1, 1>(out, x, w, bias, a, mm, n);
}

inline void linear_gemm_bf16(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w,
                             const c10::BFloat16* bias, const LinearArgs& a) {
  const int64_t nblk = gemm_n_block(a.K);
  const int64_t mb = (a.M + kGemmMBlock - 1) / kGemmMBlock, nb = (a.N + nblk - 1) / nblk;
  // Items in weight-block-major order: consecutive items of one thread reuse the same weight rows (L1/L2)
  // across x blocks, and x (M x K) stays in L2/L3 between passes.
  pagellm::cpu::parallel_for(0, mb * nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bn = item / mb, bm = item % mb;
      gemm_block_bf16(out, x, w, bias, a, bm * kGemmMBlock, std::min(a.M, (bm + 1) * kGemmMBlock),
                      bn * nblk, std::min(a.N, (bn + 1) * nblk));
    }
  });
}

}  // namespace pagellm::cpu
#endif  // PAGELLM_LINEAR_DPBF16
