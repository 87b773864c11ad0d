// Few-row bf16 path of linear_small_m (2 <= M <= 16: a speculative verify step's 1 + k rows, small decode
// batches): out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), AVX-512 only.
//
// Why: at these M the step is still bound by streaming the weight from DRAM, so M rows should cost what one
// row costs. The one-row schedule's 4 x 4 tiles spent ~15-45 % more than one row at M = 2..6 (a vsum tree and a
// scalar rounding per output, rows past a whole tile re-swept), and the GEMM schedule's tiles fit 8 and 12
// rows but not 13-16 or a remainder of 1-3 rows. Here x is packed once per call in quads of rows (zero rows pad
// the last quad: registers are cheap at these M, another sweep of the weight is not), and every weight row is
// read from memory once: at 2-4 rows (one quad) and 5-10 rows (x as it is, few_rows_wide) one weight row after another
// against every x row (the weight read start to end, one sequential stream, as at one row: session 18), at 11-16 rows
// by register tiles of 24 accumulators (of the 32 registers): 3 quads x 2 weight rows; 4 quads as two passes of 2
// quads x 3, the second finding the weight rows in L1 / L2 (4 quads x 1 weight row, 5 loads per 4 dot products, was
// no faster).
// The tile is the quad tile's arithmetic (linear_cpu_gemm_quad.h): lane 4r + i of accumulator j holds what the
// one-row kernel's accumulator of row r holds in lane 4j + i, vsum's first two levels are vertical adds and the
// last two run on 4 (quad, weight row) pairs per vector, then bias and one vector rounding: every element has the
// one-row kernel's bits (batch invariance). Weight rows are prefetched ahead and split across threads in
// contiguous runs of blocks, ~256 KiB of weight per chunk at least, as the one-row schedule splits them.
#pragma once

#include "ops/linear/linear_cpu_gemm_quad.h"
#include "ops/linear/linear_cpu_kernels.h"

#ifdef PAGELLM_GEMM_QUAD
#include <cstring>

namespace pagellm::cpu {

// Rows of M this path takes (below: the one-row kernel; above: the GEMM schedule).
constexpr int64_t kLinearFewRowsMinM = 2, kLinearFewRowsMaxM = 16;
// Software-prefetch distance in weight rows (9 / 18 KiB ahead at K = 576): a tile with more rows of x spends
// longer per weight byte, so it asks earlier (1 quad: 4 rows ahead ran 1.0x, 16 1.1x of M = 1's time; 2-4 quads:
// 16 rows 1.09-1.15x, 8 1.2x, 32 1.15-1.4x; one thread under load 8-11, benchmarks/README.md, session 15).
constexpr int64_t kFewRowsPrefetch1 = 8, kFewRowsPrefetch = 16;

// xp[quad q][chunk t][quarter j][row r][8] = x[4q + r][32t + 8j + e]; 0 past K and for rows >= M.
inline void few_rows_pack(c10::BFloat16* xp, const c10::BFloat16* x, const LinearArgs& a) {
  const int64_t num_quads = (a.M + 3) / 4, nt = (a.K + 31) / 32;
  for (int64_t q = 0; q < num_quads; ++q) {
    c10::BFloat16* dst = xp + q * quad_stride(a.K);
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t k = 32 * t;
      __m512i v[4];
      for (int i = 0; i < 4; ++i) {
        const int64_t row = 4 * q + i;
        v[i] = row < a.M ? (__m512i)bf16x32_load(x + row * a.ldx + k, a.K - k).v : _mm512_setzero_si512();
      }
      store_quad_chunk(dst + t * 128, v);
    }
  }
}

// 16 sums, lane 4L + c = row L of (quad q0 + q, weight row n0 + n) pair c of cs[0..3] (q * NW + n), + their
// biases, rounded like c10::BFloat16 (nearest-even, NaN -> 0x7fc0) and stored where the row is < M. NW = 4: a row's
// 4 outputs sit side by side (one 8-byte store); otherwise one 2-byte store per output.
template <int NW>
inline void few_rows_store(c10::BFloat16* out, __m512 v, const int* cs, const float* bias, const LinearArgs& a,
                           int q0, int64_t n0) {
  if (bias) {
    const __m128 b4 = _mm_setr_ps(bias[cs[0] % NW], bias[cs[1] % NW], bias[cs[2] % NW], bias[cs[3] % NW]);
    v = _mm512_add_ps(v, _mm512_broadcast_f32x4(b4));
  }
  alignas(32) uint16_t h[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(h), round_bf16_like_c10(v));
  if constexpr (NW == 4) {  // cs = (q, 0..3): row 4q + L's outputs n0..n0+3 are h[4L..4L+3]
    const int64_t row0 = 4 * (q0 + cs[0] / NW);
    for (int L = 0; L < 4 && row0 + L < a.M; ++L) std::memcpy(out + (row0 + L) * a.ldo + n0, h + 4 * L, 8);
  } else {
    for (int c = 0; c < 4; ++c) {
      const int64_t row0 = 4 * (q0 + cs[c] / NW), n = n0 + cs[c] % NW;
      for (int L = 0; L < 4 && row0 + L < a.M; ++L) std::memcpy(out + (row0 + L) * a.ldo + n, h + 4 * L + c, 2);
    }
  }
}

// Rows of quads [q0, q0 + Q) (packed at xq) x weight rows [n0, n0 + NW); bias: NW floats or null. The first pass
// over a block of weight rows prefetches the rows ahead; a second pass finds them in L1 / L2.
template <int Q, int NW>
__attribute__((always_inline)) inline void few_rows_tile(c10::BFloat16* out, const c10::BFloat16* xq,
                                                         const c10::BFloat16* w, const float* bias,
                                                         const LinearArgs& a, int q0, int64_t n0, int64_t pf_rows) {
  static_assert(Q * NW * 4 <= 24, "24 accumulators at most");
  __m512 acc[4][Q][NW];
  _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j)
    _Pragma("GCC unroll 4") for (int q = 0; q < Q; ++q)
      _Pragma("GCC unroll 4") for (int n = 0; n < NW; ++n) acc[j][q][n] = _mm512_setzero_ps();
  const c10::BFloat16* wr[NW];
  _Pragma("GCC unroll 4") for (int n = 0; n < NW; ++n) wr[n] = w + (n0 + n) * a.ldw;
  const int64_t qs = quad_stride(a.K), pf = pf_rows * a.ldw;
  xq += q0 * qs;
  const auto chunk = [&](int64_t k, bool tail) __attribute__((always_inline)) {
    if (pf && !tail) {
      _Pragma("GCC unroll 4") for (int n = 0; n < NW; ++n) __builtin_prefetch(wr[n] + k + pf, 0, 3);
    }
    const c10::BFloat16* xt = xq + k * 4;
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {
      __m512bh xv[Q];
      _Pragma("GCC unroll 4") for (int q = 0; q < Q; ++q) xv[q] = (__m512bh)_mm512_load_si512(xt + q * qs + 32 * j);
      _Pragma("GCC unroll 4") for (int n = 0; n < NW; ++n) {
        const BF16x32 wv = quad_weight_quarter(wr[n] + k + 8 * j, tail ? a.K - k - 8 * j : 8);
        _Pragma("GCC unroll 4") for (int q = 0; q < Q; ++q) acc[j][q][n] = vdot_bf16({acc[j][q][n]}, wv, {xv[q]}).v;
      }
    }
  };
  int64_t k = 0;
  for (; k + 32 <= a.K; k += 32) chunk(k, false);
  if (k < a.K) chunk(k, true);
  // vsum's levels 1 and 2 as vertical adds: lane 4r + i of y[c] = row r's partial i, pair c = q * NW + n.
  __m512 y[Q * NW];
  _Pragma("GCC unroll 16") for (int c = 0; c < Q * NW; ++c) {
    const int q = c / NW, n = c % NW;
    y[c] = _mm512_add_ps(_mm512_add_ps(acc[0][q][n], acc[2][q][n]), _mm512_add_ps(acc[1][q][n], acc[3][q][n]));
  }
  // Levels 3 and 4 within 128-bit lanes, 4 pairs per vector (a short last group repeats its last pair).
  _Pragma("GCC unroll 4") for (int c0 = 0; c0 < Q * NW; c0 += 4) {
    int cs[4];
    for (int c = 0; c < 4; ++c) cs[c] = std::min(c0 + c, Q * NW - 1);
    const __m512 z0 = quad_level3(y[cs[0]], y[cs[1]]), z1 = quad_level3(y[cs[2]], y[cs[3]]);
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, 0x88), _mm512_shuffle_ps(z0, z1, 0xDD));
    few_rows_store<NW>(out, s, cs, bias, a, q0, n0);
  }
}

// Quads [q0, q0 + Q) x weight rows [n_begin, n_end): NW-row tiles, then single-row tiles for the rest.
template <int Q, int NW>
inline void few_rows_pass(c10::BFloat16* out, const c10::BFloat16* xq, const c10::BFloat16* w,
                          const c10::BFloat16* bias, const LinearArgs& a, int q0, int64_t n_begin, int64_t n_end,
                          int64_t prefetch) {
  float b[NW];
  const auto load_bias = [&](int64_t n0, int nw) {
    for (int n = 0; n < nw; ++n) b[n] = bias ? static_cast<float>(bias[n0 + n]) : 0.f;
    return bias ? b : nullptr;
  };
  int64_t n = n_begin;
  for (; n + NW <= n_end; n += NW) few_rows_tile<Q, NW>(out, xq, w, load_bias(n, NW), a, q0, n, prefetch);
  if constexpr (NW > 1)
    for (; n < n_end; ++n) few_rows_tile<Q, 1>(out, xq, w, load_bias(n, 1), a, q0, n, prefetch);
}

// Weight row n against all Q quads (every x row) at once (used at Q = 1: 2-4 rows). Called for n = n_begin,
// n_begin + 1, ..., it reads the weight start to end, one sequential stream, as the one-row kernel does
// (linear_weight_rows), where few_rows_tile reads NW rows side by side. The K loop is few_rows_tile's (lane 4r + i of acc[j][q] = the one-row kernel's lane 4j + i of
// row 4q + r); vsum's levels 3-4 on the Q quads' sums in one vector, + bias, one rounding: the same bits.
template <int Q>
__attribute__((always_inline)) inline void few_rows_row_tile(c10::BFloat16* out, const c10::BFloat16* xq,
                                                             const c10::BFloat16* wr, float bias,
                                                             const LinearArgs& a, int64_t n, int64_t pf) {
  static_assert(Q >= 1 && Q <= 4, "one vector of 4 quads' sums");
  __m512 acc[4][Q];
  _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j)
    _Pragma("GCC unroll 4") for (int q = 0; q < Q; ++q) acc[j][q] = _mm512_setzero_ps();
  const int64_t qs = quad_stride(a.K);
  const auto chunk = [&](int64_t k, bool tail) __attribute__((always_inline)) {
    if (!tail) __builtin_prefetch(wr + k + pf, 0, 3);
    const c10::BFloat16* xt = xq + k * 4;
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; ++j) {
      const BF16x32 wv = quad_weight_quarter(wr + k + 8 * j, tail ? a.K - k - 8 * j : 8);
      _Pragma("GCC unroll 4") for (int q = 0; q < Q; ++q)
        acc[j][q] = vdot_bf16({acc[j][q]}, wv, {(__m512bh)_mm512_load_si512(xt + q * qs + 32 * j)}).v;
    }
  };
  int64_t k = 0;
  for (; k + 32 <= a.K; k += 32) chunk(k, false);
  if (k < a.K) chunk(k, true);
  __m512 y[4];
  _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q) {  // vsum's levels 1-2; missing quads repeat the last one
    const int c = q < Q ? q : Q - 1;
    y[q] = _mm512_add_ps(_mm512_add_ps(acc[0][c], acc[2][c]), _mm512_add_ps(acc[1][c], acc[3][c]));
  }
  const __m512 z0 = quad_level3(y[0], y[1]), z1 = quad_level3(y[2], y[3]);
  __m512 v = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, 0x88), _mm512_shuffle_ps(z0, z1, 0xDD));
  // lane 4L + q holds row 4q + L: to row order, then + bias
  v = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
  v = _mm512_add_ps(v, _mm512_set1_ps(bias));
  alignas(32) uint16_t h[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(h), round_bf16_like_c10(v));
  for (int64_t r = 0; r < a.M; ++r) std::memcpy(out + r * a.ldo + n, h + r, 2);
}

// Weight rows [n_begin, n_end) one after another (few_rows_row_tile), prefetched pf_rows rows ahead.
template <int Q>
inline void few_rows_by_row(c10::BFloat16* out, const c10::BFloat16* xq, const c10::BFloat16* w,
                            const c10::BFloat16* bias, const LinearArgs& a, int64_t n_begin, int64_t n_end,
                            int64_t pf_rows) {
  const int64_t pf = pf_rows * a.ldw;
  for (int64_t n = n_begin; n < n_end; ++n)
    few_rows_row_tile<Q>(out, xq, w + n * a.ldw, bias ? static_cast<float>(bias[n]) : 0.f, a, n, pf);
}

// 5-8 rows (MR): weight row n against every x row in the one-row kernel's own layout (x unpacked: one 32-element
// load per row and chunk, the weight chunk loaded once, no broadcasts: MR + 1 loads per MR dot products where two
// quads took 12 per 8), weight rows one after another. The MR sums run vsum's exact tree side by side: level 1 (lane
// i + lane i + 8) on pairs of accumulators' 256-bit halves, level 2 (i + i + 4) on 128-bit blocks, levels 3-4 within
// blocks (quad_level3, then lanes 0 + 1): 23 vector ops for the MR outputs instead of MR horizontal reductions; then
// bias and one vector rounding: each output the one-row kernel's bits.
// The MR <= 8 sums of acc[0..8) (vsum's tree side by side, see few_rows_wide_tile) + bias, rounded, stored to
// out[r * ldo + n] for rows r < MR.
template <int MR>
__attribute__((always_inline)) inline void few_rows_wide_store(c10::BFloat16* out, const __m512* acc, float bias,
                                                               const LinearArgs& a, int64_t n) {
  // level 1: h[p] lanes 0-7 = row 2p's lane i + lane i + 8, lanes 8-15 = row 2p + 1's
  __m512 h[4];
  _Pragma("GCC unroll 4") for (int p = 0; p < 4; ++p)
    h[p] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0xEE));
  // level 2: 128-bit block b of g0 = row b's (h[i] + h[i + 4]), i < 4; g1: rows 4..7
  const __m512 g0 = _mm512_add_ps(_mm512_shuffle_f32x4(h[0], h[1], 0x88), _mm512_shuffle_f32x4(h[0], h[1], 0xDD));
  const __m512 g1 = _mm512_add_ps(_mm512_shuffle_f32x4(h[2], h[3], 0x88), _mm512_shuffle_f32x4(h[2], h[3], 0xDD));
  // levels 3-4: block b = (row b: q0 + q2, q1 + q3, row 4 + b: ...), then lanes 0 + 1 and 2 + 3
  const __m512 z = quad_level3(g0, g1);
  __m512 v = _mm512_add_ps(z, _mm512_permute_ps(z, 0xB1));
  v = _mm512_add_ps(v, _mm512_set1_ps(bias));
  alignas(32) uint16_t hv[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(hv), round_bf16_like_c10(v));
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)  // row r < 4 in lane 4r, row 4 + b in lane 4b + 2
    std::memcpy(out + r * a.ldo + n, hv + (r < 4 ? 4 * r : 4 * (r - 4) + 2), 2);
}

// 5-10 rows (MR, few_rows_takes_wide): weight row n against every x row in the one-row kernel's own layout (x unpacked: one 32-element
// load per row and chunk, the weight chunk loaded once, no broadcasts: MR + 1 loads per MR dot products where two
// quads took 12 per 8), weight rows one after another. Each group of 8 sums runs vsum's exact tree side by side:
// level 1 (lane i + lane i + 8) on pairs of accumulators' 256-bit halves, level 2 (i + i + 4) on 128-bit blocks,
// levels 3-4 within blocks (quad_level3, then lanes 0 + 1): 23 vector ops for 8 outputs instead of 8 horizontal
// reductions; then bias and one vector rounding: each output the one-row kernel's bits.
template <int MR>
__attribute__((always_inline)) inline void few_rows_wide_tile(c10::BFloat16* out, const c10::BFloat16* x,
                                                              const c10::BFloat16* wr, float bias,
                                                              const LinearArgs& a, int64_t n, int64_t pf) {
  static_assert(MR >= 5 && MR <= 16, "16 accumulators at most");  // 11-16 compile, but ran slower (above)
  constexpr int kAcc = MR > 8 ? 16 : 8;
  __m512 acc[kAcc];
  _Pragma("GCC unroll 16") for (int r = 0; r < kAcc; ++r) acc[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= a.K; k += 32) {
    __builtin_prefetch(wr + k + pf, 0, 3);
    const BF16x32 wv = bf16x32_load(wr + k);
    _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r)
      acc[r] = vdot_bf16({acc[r]}, wv, bf16x32_load(x + r * a.ldx + k)).v;
  }
  if (k < a.K) {
    const BF16x32 wv = bf16x32_load(wr + k, a.K - k);
    _Pragma("GCC unroll 16") for (int r = 0; r < MR; ++r)
      acc[r] = vdot_bf16({acc[r]}, wv, bf16x32_load(x + r * a.ldx + k, a.K - k)).v;
  }
  few_rows_wide_store<MR < 8 ? MR : 8>(out, acc, bias, a, n);
  if constexpr (MR > 8) few_rows_wide_store<MR - 8>(out + 8 * a.ldo, acc + 8, bias, a, n);
}

template <int MR>
inline void few_rows_wide(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w,
                          const c10::BFloat16* bias, const LinearArgs& a, int64_t n_begin, int64_t n_end) {
  // ~9 KiB ahead (8 rows at K = 576, 3 at K = 1536): 8 rows of down's K = 1536 ahead (24 KiB) beside 8 x rows
  // (24 KiB) filled L1, and 8 rows cost 1.33-1.38x one row's time there against 1.10-1.13x at K = 576
  const int64_t pf = std::max<int64_t>(2, (9 << 10) / std::max<int64_t>(2 * a.K, 1)) * a.ldw;
  for (int64_t n = n_begin; n < n_end; ++n)
    few_rows_wide_tile<MR>(out, x, w + n * a.ldw, bias ? static_cast<float>(bias[n]) : 0.f, a, n, pf);
}

// Rows few_rows_wide takes: 5-8, and 9-10 while their x rows stay small (K <= 768: 11.5 KiB of bf16). At 9-10 rows
// and K = 576 it took 1.17-1.36x one row's time where the quad tiles took 1.45-1.66x; at 11-13 rows the two were
// even, at 16 rows and at K = 1536 from 9 rows it ran 1.1-1.5x the quad tiles' time (session 18).
inline bool few_rows_takes_wide(const LinearArgs& a) { return a.M >= 5 && (a.M <= 8 || (a.M <= 10 && a.K <= 768)); }

// x is packed in quads unless few_rows_wide reads it as it is.
inline bool few_rows_packs_x(const LinearArgs& a) { return !few_rows_takes_wide(a); }

// Weight rows per block: a multiple of every tile's NW (4, 3, 2); 27 KiB at K = 576, so a 4-quad M's second pass
// over the block finds its rows in L1 (L2 at K = 1536).
constexpr int64_t kFewRowsNBlock = 24;

// Weight rows [n_begin, n_end) for all M rows. One weight row after another against every x row at 2-10 rows: one
// quad (few_rows_by_row) or 5-10 rows in the one-row layout (few_rows_wide, few_rows_takes_wide); session 18 measured
// 0.97-1.05x one row's time at 2-5 rows, 1.02-1.2x at 7-8 and 1.17-1.36x at 9-10 (K = 576) where the side-by-side
// quad tiles took 1.15-1.3x, 1.2-1.3x and 1.45-1.66x: one sequential stream, as at one row. Two quads row by row took
// 1.1-1.2x (3 loads per 2 dot products, one a broadcast). At 11-16 rows (9-16 at K = 1536) each x load feeding one dot
// product makes the K loop load-bound, so: 3 quads x 2 weight rows side by side; 4 quads as two passes of 2 quads x 3
// (5 loads per 6 dot products).
inline void few_rows_range(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* xq,
                           const c10::BFloat16* w, const c10::BFloat16* bias, const LinearArgs& a, int64_t n_begin,
                           int64_t n_end) {
  if (few_rows_takes_wide(a)) {
    switch (a.M) {
      case 5: few_rows_wide<5>(out, x, w, bias, a, n_begin, n_end); return;
      case 6: few_rows_wide<6>(out, x, w, bias, a, n_begin, n_end); return;
      case 7: few_rows_wide<7>(out, x, w, bias, a, n_begin, n_end); return;
      case 8: few_rows_wide<8>(out, x, w, bias, a, n_begin, n_end); return;
      case 9: few_rows_wide<9>(out, x, w, bias, a, n_begin, n_end); return;
      default: few_rows_wide<10>(out, x, w, bias, a, n_begin, n_end); return;
    }
  }
  const int64_t num_quads = (a.M + 3) / 4;
  const bool small_x = 32 * a.K <= (24 << 10);  // 4 packed quads fit half of L1 (K <= 768)
  if (num_quads == 1) {
    few_rows_by_row<1>(out, xq, w, bias, a, n_begin, n_end, kFewRowsPrefetch1);
    return;
  }
  // 4 quads: both passes per 3 weight rows while the 4 packed quads fit half of L1 (at K = 576, 13-16 rows ran 1.3x
  // M = 1's time against 1.5x with whole blocks), else per block (K = 1536: 1.8x against 2.0x).
  const int64_t sub = small_x ? 3 : kFewRowsNBlock;
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kFewRowsNBlock) {
    const int64_t n1 = std::min(n_end, n0 + kFewRowsNBlock);
    if (num_quads == 3) {
      few_rows_pass<3, 2>(out, xq, w, bias, a, 0, n0, n1, kFewRowsPrefetch);
      continue;
    }
    for (int64_t s0 = n0; s0 < n1; s0 += sub) {
      const int64_t s1 = std::min(n1, s0 + sub);
      few_rows_pass<2, 3>(out, xq, w, bias, a, 0, s0, s1, kFewRowsPrefetch);
      few_rows_pass<2, 3>(out, xq, w, bias, a, 2, s0, s1, 0);
    }
  }
}

inline void linear_few_rows_bf16(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w,
                                 const c10::BFloat16* bias, const LinearArgs& a) {
  const int64_t num_quads = (a.M + 3) / 4;
  // The caller packs x once into its own buffer; the pool's workers read it while the caller waits in parallel_for.
  c10::BFloat16* xq = nullptr;
  if (few_rows_packs_x(a)) {
    xq = quad_scratch<struct FewRowsScratch>(num_quads * quad_stride(a.K));
    few_rows_pack(xq, x, a);
  }
  // Blocks split across threads, ~>= 256 KiB of weight per chunk as the one-row schedule: small matrices inline.
  const int64_t blocks = (a.N + kFewRowsNBlock - 1) / kFewRowsNBlock;
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(kFewRowsNBlock * a.K * 2, 1));
  pagellm::cpu::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    few_rows_range(out, x, xq, w, bias, a, begin * kFewRowsNBlock, std::min(a.N, end * kFewRowsNBlock));
  });
}

}  // namespace pagellm::cpu
#endif  // PAGELLM_GEMM_QUAD
