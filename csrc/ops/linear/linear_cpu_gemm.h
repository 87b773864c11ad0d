// Many-row bf16 path of linear_small_m (prefill chunks, batched decode): out[M, N] = x[M, K] @ w[N, K]^T.
//
// Every (row, output) element is computed exactly as the one-row kernel computes it (linear_cpu_kernels.h:
// one 16-lane fp32 accumulator over K in steps of 32 with vdpbf16ps, the same masked tail, vsum's reduction
// tree, + bias, one round-to-nearest-even), so results are bit-identical whatever M is (batch invariance).
// What changes is only the schedule. AVX-512: each thread packs an x block's rows in quads once per call and runs
// 12 x-row x 2 weight-row quad tiles (linear_cpu_gemm_quad.h: vsum's first two levels become vertical adds) over
// work items of (x block, 32 weight rows); the rows past the last whole quad and an odd last weight row take the
// tiles below. AVX2 (the vdpbf16ps emulation): 6 x-rows x 4 weight-rows register tiles (24 accumulators, 10 loads
// per 24 vdpbf16ps), the horizontal sums done side by side (vsum_each16 / vsum_each8), items of (x block, 16
// weight rows). Items are taken x-block-major, so each x block stays in L2 while the weight passes.
#pragma once

#include "ops/linear/linear_cpu_gemm_quad.h"
#include "ops/linear/linear_cpu_kernels.h"

#include <atomic>
#include <cstring>

#ifdef PAGELLM_LINEAR_DPBF16
namespace pagellm::cpu {

// out[i] = vsum(v[i]) bit for bit, for 16 vectors at once: vsum's own tree (lanes i + i+8, then i + i+4,
// i + i+2, i + i+1) run on the 16 vectors side by side (15 vector adds instead of 64 scalar-ish steps), then
// one permute into order. Float addition commutes exactly, so only the pairing has to match vsum's.
inline void vsum_each16(const VecF* v, float* out) {
#ifdef PAGELLM_AVX512
  __m512 x[8], y[4];
  // lanes 0-7: v[2p]'s i + i+8; lanes 8-15: v[2p+1]'s (i+8) + i. The blend keeps each vector's own half in place
  // and one cross-lane shuffle brings the partner halves: half the shuffles of two 0x44 / 0xEE shuffles.
  for (int p = 0; p < 8; ++p)
    x[p] = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, v[2 * p].v, v[2 * p + 1].v),
                         _mm512_shuffle_f32x4(v[2 * p].v, v[2 * p + 1].v, 0x4E));
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

// out[i] = vsum(v[i]) bit for bit for 8 vectors: the first half of vsum_each16's tree (same pairings).
inline void vsum_each8(const VecF* v, float* out) {
#ifdef PAGELLM_AVX512
  __m512 x[4], y[2];
  for (int p = 0; p < 4; ++p)
    x[p] = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, v[2 * p].v, v[2 * p + 1].v),
                         _mm512_shuffle_f32x4(v[2 * p].v, v[2 * p + 1].v, 0x4E));
  for (int p = 0; p < 2; ++p)
    y[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0xDD));
  const __m512d da = _mm512_castps_pd(y[0]), db = _mm512_castps_pd(y[1]);
  // 128-bit lane L: (L, 4 + L) as two partials each
  const __m512 z = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(da, db)), _mm512_castpd_ps(_mm512_unpackhi_pd(da, db)));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z, z, 0x88), _mm512_shuffle_ps(z, z, 0xDD));  // lane 4L + j: v[4j + L]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, r)));
#else
  for (int i = 0; i < 8; ++i) out[i] = vsum(v[i]);
#endif
}

// Rows of M from which linear_small_m takes this path (below it, the weight-streaming schedule is as fast).
constexpr int64_t kLinearGemmMinM = 8;
// Register tile: 6 x rows x 4 weight rows = 24 accumulators + 4 weight vectors + 1 x vector of the 32 zmm
// registers; 10 loads per 24 vdpbf16ps (4 x 4: 8 per 16). On Zen 5 it beat 4x6, 8x3, 8x2 and 3x8 in this schedule
// and was -3 to +5 % against 4x4 with the same blocking (benchmarks/README.md, session 13).
constexpr int kGemmTileM = 6, kGemmTileN = 4;

// Rows `rows` (<= 4) of 4 sums s[4 i + j] (+ bias4[j]) rounded like c10::BFloat16 (nearest-even, NaN -> 0x7fc0)
// and stored at out[(m0 + i) * ldo + n0 + j].
inline void gemm_store_rows_bf16(c10::BFloat16* out, const float* s, const float* bias4, const LinearArgs& a,
                                 int64_t m0, int64_t n0, int rows) {
#ifdef PAGELLM_AVX512
  __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (4 * rows)) - 1u), s);
  if (bias4) v = _mm512_add_ps(v, _mm512_broadcast_f32x4(_mm_loadu_ps(bias4)));
  alignas(32) uint64_t h[4];  // row i's 4 bf16 values
  _mm256_store_si256(reinterpret_cast<__m256i*>(h), round_bf16_like_c10(v));
  for (int i = 0; i < rows; ++i) std::memcpy(out + (m0 + i) * a.ldo + n0, &h[i], sizeof(uint64_t));
#else
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < 4; ++j)
      out[(m0 + i) * a.ldo + n0 + j] = c10::BFloat16(bias4 ? s[i * 4 + j] + bias4[j] : s[i * 4 + j]);
#endif
}

// x rows [m0, m0 + MR) x weight rows [n0, n0 + 4), MR = 2, 4 or 6: the one-row kernel's K loop per accumulator.
template <int MR>
inline void gemm_tile_bf16(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w, const float* bias4,
                           const LinearArgs& a, int64_t m0, int64_t n0, bool prefetch) {
  static_assert(MR == 2 || MR == 4 || MR == 6, "the epilogue reduces 16 and / or 8 sums");
  constexpr int NR = kGemmTileN;
  VecF acc[MR * NR];
  _Pragma("GCC unroll 24")
  for (int i = 0; i < MR * NR; ++i) acc[i] = vzero();
  const c10::BFloat16* xr[MR];
  const c10::BFloat16* wr[NR];
  _Pragma("GCC unroll 6")
  for (int i = 0; i < MR; ++i) xr[i] = x + (m0 + i) * a.ldx;
  _Pragma("GCC unroll 4")
  for (int j = 0; j < NR; ++j) wr[j] = w + (n0 + j) * a.ldw;
  // The first x tile of a block meets its weight rows first (from DRAM for a big LM head): fetch rows ahead.
  const int64_t pf = prefetch ? kLinearPrefetchRows * a.ldw : 0;
  int64_t k = 0;
  for (; k + 32 <= a.K; k += 32) {
    BF16x32 wv[NR];
    _Pragma("GCC unroll 4")
    for (int j = 0; j < NR; ++j) {
      if (pf) __builtin_prefetch(wr[j] + k + pf, 0, 3);
      wv[j] = bf16x32_load(wr[j] + k);
    }
    _Pragma("GCC unroll 6")
    for (int i = 0; i < MR; ++i) {
      const BF16x32 xv = bf16x32_load(xr[i] + k);
      _Pragma("GCC unroll 4")
      for (int j = 0; j < NR; ++j) acc[i * NR + j] = vdot_bf16(acc[i * NR + j], wv[j], xv);
    }
  }
  if (k < a.K) {
    BF16x32 wv[NR];
    _Pragma("GCC unroll 4")
    for (int j = 0; j < NR; ++j) wv[j] = bf16x32_load(wr[j] + k, a.K - k);
    _Pragma("GCC unroll 6")
    for (int i = 0; i < MR; ++i) {
      const BF16x32 xv = bf16x32_load(xr[i] + k, a.K - k);
      _Pragma("GCC unroll 4")
      for (int j = 0; j < NR; ++j) acc[i * NR + j] = vdot_bf16(acc[i * NR + j], wv[j], xv);
    }
  }
  alignas(64) float s[MR * NR];
  if constexpr (MR >= 4) {
    vsum_each16(acc, s);
    gemm_store_rows_bf16(out, s, bias4, a, m0, n0, 4);
  }
  if constexpr (MR != 4) {
    vsum_each8(acc + MR * NR - 8, s + MR * NR - 8);
    gemm_store_rows_bf16(out, s + MR * NR - 8, bias4, a, m0 + MR - 2, n0, 2);
  }
}

// Work item sizes: x rows per block (~256 KiB of x, a quarter of a 1 MiB L2, a multiple of both tiles' 6 and 12
// rows) and weight rows per item (16: 18 KiB at K = 576, L1-resident while every x tile of the block sweeps them).
inline int64_t gemm_m_block(int64_t K) {
  constexpr int64_t kRows = 12;
  return std::max<int64_t>((256 << 10) / (2 * std::max<int64_t>(K, 1)) / kRows, 1) * kRows;
}
constexpr int64_t kGemmNBlock = 16;
// The quad tiles' items take 32 weight rows (36 KiB at K = 576, L2): each packed 12-row x tile then serves 16
// tiles per load from L2. 32-64 rows ran 5-15 % faster than 16 at 64-2048 rows (benchmarks/README.md, session 14).
constexpr int64_t kGemmQuadNBlock = 32;
constexpr int64_t kGemmMaxNBlock = std::max(kGemmNBlock, kGemmQuadNBlock);
constexpr int kGemmChunksPerThread = 16;

// Rows [m0, m1) x weight rows [n0, n1): 6 x 4 tiles, 4 x 4 and 2 x 4 ones, and the one-row kernel's on the edges.
inline void gemm_block_bf16(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w,
                            const c10::BFloat16* bias, const LinearArgs& a, int64_t m0, int64_t m1, int64_t n0,
                            int64_t n1) {
  const int64_t n4 = n0 + (n1 - n0) / 4 * 4;
  float b[kGemmMaxNBlock];
  for (int64_t n = n0; n < n4; ++n) b[n - n0] = bias ? static_cast<float>(bias[n]) : 0.f;
  const auto b4 = [&](int64_t n) { return bias ? b + (n - n0) : nullptr; };
  // Rows as 6-row tiles, then 4-, 2- and 1-row ones: 8 = 4 + 4 and 9 = 4 + 4 + 1 rather than 6 + two rows of the
  // one-row kernel, which would re-read the weight rows per row (from L2 where they fill L1, K = 1536).
  int64_t num_tiles6 = (m1 - m0) / kGemmTileM;
  if ((m1 - m0) % kGemmTileM >= 2 && (m1 - m0) % kGemmTileM <= 3 && num_tiles6 > 0) --num_tiles6;
  int64_t m = m0;
  // x tile outer, weight tiles inner: the item's weight rows stay in L1 for every x tile.
  for (; m < m0 + num_tiles6 * kGemmTileM; m += kGemmTileM)
    for (int64_t n = n0; n < n4; n += 4) gemm_tile_bf16<kGemmTileM>(out, x, w, b4(n), a, m, n, m == m0);
  for (; m + 4 <= m1; m += 4)
    for (int64_t n = n0; n < n4; n += 4) gemm_tile_bf16<4>(out, x, w, b4(n), a, m, n, m == m0);
  if (m + 2 <= m1) {
    for (int64_t n = n0; n < n4; n += 4) gemm_tile_bf16<2>(out, x, w, b4(n), a, m, n, m == m0);
    m += 2;
  }
  if (m < m1)
    for (int64_t n = n0; n < n4; n += 4) linear_tile<1, 4>(out, x, w, bias, a, m, n);
  for (int64_t n = n4; n < n1; ++n)
    for (int64_t mm = m0; mm < m1; ++mm) linear_tile<1, 1>(out, x, w, bias, a, mm, n);
}

#ifdef PAGELLM_GEMM_QUAD
// Rows [m0, m1) (whole quads packed at xq) x weight rows [n0, n1): quad tiles, x tile outer so the item's weight
// rows stay in L1; the rows after the last whole quad and an odd last weight row take gemm_block_bf16's tiles.
inline void gemm_block_quad(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* xq,
                            const c10::BFloat16* w, const c10::BFloat16* bias, const LinearArgs& a, int64_t m0,
                            int64_t m1, int64_t n0, int64_t n1) {
  const int64_t nq = (m1 - m0) / 4, mq = m0 + 4 * nq, n2 = n0 + (n1 - n0) / 2 * 2, qs = quad_stride(a.K);
  float b[kGemmMaxNBlock];
  for (int64_t n = n0; n < n2; ++n) b[n - n0] = bias ? static_cast<float>(bias[n]) : 0.f;
  const auto b2 = [&](int64_t n) { return bias ? b + (n - n0) : nullptr; };
  // 3-quad tiles, then a 2-quad one for a remainder of 2 and two for a remainder of 1 (16 quads, 64 decode rows:
  // 4 x 3 + 2 x 2, not 5 x 3 + 1: a 1-quad tile has 8 accumulator chains, too few to hide vdpbf16ps' latency).
  const int64_t nq3 = nq % kQuadTileQuads == 1 && nq > kQuadTileQuads ? nq / kQuadTileQuads - 1 : nq / kQuadTileQuads;
  int64_t q = 0;
  for (; q < nq3 * kQuadTileQuads; q += kQuadTileQuads)
    for (int64_t n = n0; n < n2; n += 2) gemm_quad_tile<kQuadTileQuads>(out, xq + q * qs, w, b2(n), a, m0 + 4 * q, n, q == 0);
  for (; nq - q >= 2; q += 2)
    for (int64_t n = n0; n < n2; n += 2) gemm_quad_tile<2>(out, xq + q * qs, w, b2(n), a, m0 + 4 * q, n, q == 0);
  if (nq - q == 1)
    for (int64_t n = n0; n < n2; n += 2) gemm_quad_tile<1>(out, xq + q * qs, w, b2(n), a, m0 + 4 * q, n, q == 0);
  if (n2 < n1 && mq > m0) gemm_block_bf16(out, x, w, bias, a, m0, mq, n2, n1);
  if (mq < m1) gemm_block_bf16(out, x, w, bias, a, mq, m1, n0, n1);
}

#endif

inline void linear_gemm_bf16(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w,
                             const c10::BFloat16* bias, const LinearArgs& a) {
  const int64_t mblk = gemm_m_block(a.K);
#ifdef PAGELLM_GEMM_QUAD
  constexpr int64_t nblk = kGemmQuadNBlock;
#else
  constexpr int64_t nblk = kGemmNBlock;
#endif
  const int64_t mb = (a.M + mblk - 1) / mblk, nb = (a.N + nblk - 1) / nblk;
#ifdef PAGELLM_GEMM_QUAD
  // Each thread packs an x block's quads once per call into its own buffer: the (call, block) it holds is
  // remembered, so a thread's later chunks of the same block reuse it and no call can see another's data.
  static std::atomic<uint64_t> num_calls{0};
  const uint64_t call = num_calls.fetch_add(1, std::memory_order_relaxed) + 1;
  struct Packed {
    uint64_t call = 0;
    int64_t bm = -1;
  };
#endif
  // Items in x-block-major order: a thread's consecutive items share one x block (L2) while the weight
  // (at most a few MiB here, L3) passes once per x block; at M <= one block the weight streams once.
  // kGemmChunksPerThread chunks per thread (the pool's default: 4): a 64-row decode projection of 18-30
  // items then runs in chunks of 1 item and a 2048-row one in chunks of ~1/32 of the call, so the thread
  // that finishes first waits at most one short chunk for the other (or takes it over).
  pagellm::cpu::parallel_for(0, mb * nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bm = item / nb, bn = item % nb;
      const int64_t m0 = bm * mblk, m1 = std::min(a.M, (bm + 1) * mblk);
      const int64_t n0 = bn * nblk, n1 = std::min(a.N, (bn + 1) * nblk);
#ifdef PAGELLM_GEMM_QUAD
      thread_local Packed packed;
      c10::BFloat16* xq = quad_scratch<struct GemmQuadScratch>(mblk * quad_stride(a.K) / 4);
      if (packed.call != call || packed.bm != bm) {
        gemm_pack_quads(xq, x, a, m0, (m1 - m0) / 4);
        packed = {call, bm};
      }
      gemm_block_quad(out, x, xq, w, bias, a, m0, m1, n0, n1);
#else
      gemm_block_bf16(out, x, w, bias, a, m0, m1, n0, n1);
#endif
    }
  }, kGemmChunksPerThread);
}

}  // namespace pagellm::cpu
#endif  // PAGELLM_LINEAR_DPBF16
