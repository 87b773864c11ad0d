// Small-M linear: out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), fp32 accumulation, one rounding.
//
// Decode GEMV/GEMM-with-few-rows is bound by streaming the weight once from DRAM. The kernel walks
// N in tiles of NR consecutive weight rows (a contiguous NR*K block when w is contiguous) split across
// threads in chunks of whole tiles; inside a tile, x (tiny, L1-resident) is swept in blocks of MR rows
// so the NR weight rows are pulled from DRAM once and re-read from L1 for the other M blocks (one x row: the
// tile's weight rows one after another, linear_weight_rows). Each
// (m, n) keeps a 16-lane fp32 accumulator over K that is reduced horizontally at the end.
// bf16 x/w use AVX512-BF16 `vdpbf16ps` on pairs (32 elements per instruction); other dtypes convert to
// fp32 (cpu_vec.h) and use FMA. K tails use masked loads (both operands zeroed, so no garbage NaNs).
#pragma once

#include "ops/common/parallel.h"

#include "ops/common/cpu_vec.h"

namespace pagellm::cpu {

struct LinearArgs {
  int64_t M, N, K;
  int64_t ldx, ldw, ldo;  // row strides (elements); last dims contiguous
};

// Software-prefetch distance, in weight rows ahead of the current one (~ a few KiB ahead).
constexpr int64_t kLinearPrefetchRows = 8;

template <typename T>
inline void linear_store(T* p, float v) {
  *p = static_cast<T>(v);
}

#ifdef PAGELLM_AVX512
// 16 fp32 lanes rounded as linear_store's static_cast<c10::BFloat16> rounds them (nearest-even, denormals kept,
// NaN -> 0x7fc0): the vector store of the many-row schedules, so each output keeps the one-row kernel's bits.
inline __m256i round_bf16_like_c10(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}
#endif

// ---------------------------------------------------------------- generic (fp32 FMA) tile
template <int MR, int NR, typename T>
inline void linear_tile_fma(T* out, const T* x, const T* w, const T* bias, const LinearArgs& a, int64_t m0,
                            int64_t n0) {
  VecF acc[MR][NR];
  _Pragma("GCC unroll 16")
  for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 16")
    for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  const T* xr[MR];
  const T* wr[NR];
  _Pragma("GCC unroll 16")
  for (int i = 0; i < MR; ++i) xr[i] = x + (m0 + i) * a.ldx;
  _Pragma("GCC unroll 16")
  for (int j = 0; j < NR; ++j) wr[j] = w + (n0 + j) * a.ldw;
  // As the bf16 tile: without it an fp32 M = 1 stream ran at ~0.55x on one thread (a model of the decode step)
  const int64_t pf = kLinearPrefetchRows * a.ldw;
  const bool first_mblock = (m0 == 0);
  int64_t k = 0;
  for (; k + kLanes <= a.K; k += kLanes) {
    VecF wv[NR];
    _Pragma("GCC unroll 16")
    for (int j = 0; j < NR; ++j) {
      if (first_mblock) __builtin_prefetch(wr[j] + k + pf, 0, 3);  // one line of fp32 (16 lanes) per row
      wv[j] = vload(wr[j] + k);
    }
    _Pragma("GCC unroll 16")
    for (int i = 0; i < MR; ++i) {
      VecF xv = vload(xr[i] + k);
      _Pragma("GCC unroll 16")
      for (int j = 0; j < NR; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  if (k < a.K) {
    const int n = static_cast<int>(a.K - k);
    VecF wv[NR];
    _Pragma("GCC unroll 16")
    for (int j = 0; j < NR; ++j) wv[j] = vload(wr[j] + k, n);
    _Pragma("GCC unroll 16")
    for (int i = 0; i < MR; ++i) {
      VecF xv = vload(xr[i] + k, n);
      _Pragma("GCC unroll 16")
      for (int j = 0; j < NR; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  _Pragma("GCC unroll 16")
  for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 16")
    for (int j = 0; j < NR; ++j) {
      float s = vsum(acc[i][j]);
      if (bias) s += static_cast<float>(bias[n0 + j]);
      linear_store(out + (m0 + i) * a.ldo + n0 + j, s);
    }
}

#ifdef PAGELLM_BF16_DOT  // vdpbf16ps, or its exact AVX2 emulation (cpu_vec_avx2.h)
#define PAGELLM_LINEAR_DPBF16 1
// ---------------------------------------------------------------- bf16 tile (vdpbf16ps)
template <int MR, int NR>
inline void linear_tile_bf16(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w,
                             const c10::BFloat16* bias, const LinearArgs& a, int64_t m0, int64_t n0) {
  VecF acc[MR][NR];
  _Pragma("GCC unroll 16")
  for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 16")
    for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  const c10::BFloat16* xr[MR];
  const c10::BFloat16* wr[NR];
  _Pragma("GCC unroll 16")
  for (int i = 0; i < MR; ++i) xr[i] = x + (m0 + i) * a.ldx;
  _Pragma("GCC unroll 16")
  for (int j = 0; j < NR; ++j) wr[j] = w + (n0 + j) * a.ldw;
  const int64_t pf = kLinearPrefetchRows * a.ldw;
  const bool first_mblock = (m0 == 0);
  int64_t k = 0;
  for (; k + 32 <= a.K; k += 32) {
    BF16x32 wv[NR];
    _Pragma("GCC unroll 16")
    for (int j = 0; j < NR; ++j) {
      if (first_mblock) __builtin_prefetch(wr[j] + k + pf, 0, 3);
      wv[j] = bf16x32_load(wr[j] + k);
    }
    _Pragma("GCC unroll 16")
    for (int i = 0; i < MR; ++i) {
      BF16x32 xv = bf16x32_load(xr[i] + k);
      _Pragma("GCC unroll 16")
      for (int j = 0; j < NR; ++j) acc[i][j] = vdot_bf16(acc[i][j], wv[j], xv);
    }
  }
  if (k < a.K) {
    BF16x32 wv[NR];
    _Pragma("GCC unroll 16")
    for (int j = 0; j < NR; ++j) wv[j] = bf16x32_load(wr[j] + k, a.K - k);
    _Pragma("GCC unroll 16")
    for (int i = 0; i < MR; ++i) {
      BF16x32 xv = bf16x32_load(xr[i] + k, a.K - k);
      _Pragma("GCC unroll 16")
      for (int j = 0; j < NR; ++j) acc[i][j] = vdot_bf16(acc[i][j], wv[j], xv);
    }
  }
  _Pragma("GCC unroll 16")
  for (int i = 0; i < MR; ++i)
    _Pragma("GCC unroll 16")
    for (int j = 0; j < NR; ++j) {
      float s = vsum(acc[i][j]);
      if (bias) s += static_cast<float>(bias[n0 + j]);
      out[(m0 + i) * a.ldo + n0 + j] = c10::BFloat16(s);  // round-to-nearest-even
    }
}
#endif

template <int MR, int NR, typename T>
inline void linear_tile(T* out, const T* x, const T* w, const T* bias, const LinearArgs& a, int64_t m0, int64_t n0) {
#ifdef PAGELLM_LINEAR_DPBF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    linear_tile_bf16<MR, NR>(out, x, w, bias, a, m0, n0);
    return;
  } else
#endif
  {
    linear_tile_fma<MR, NR>(out, x, w, bias, a, m0, n0);
  }
}

// All M rows against weight rows [n0, n0 + NR).
template <int NR, typename T>
inline void linear_ntile(T* out, const T* x, const T* w, const T* bias, const LinearArgs& a, int64_t n0) {
  constexpr int MR = NR >= 8 ? 2 : 4;  // MR * NR <= 16 accumulators
  int64_t m = 0;
  for (; m + MR <= a.M; m += MR) linear_tile<MR, NR>(out, x, w, bias, a, m, n0);
  switch (a.M - m) {
    case 3: linear_tile<3, NR>(out, x, w, bias, a, m, n0); break;
    case 2: linear_tile<2, NR>(out, x, w, bias, a, m, n0); break;
    case 1: linear_tile<1, NR>(out, x, w, bias, a, m, n0); break;
    default: break;
  }
}

// Weight rows [n_begin, n_end) one after another against every x row: with one x row (batch-1 decode) each weight
// row is then read start to end, one sequential stream, where the 4-row tile reads four rows a row apart side by
// side. On the 2-core AMD EPYC the sequential stream took 0.71-0.79x the 4-row tile's time for the default model's
// bf16 projections and head (one and two threads; fp32: 0.89x on one thread, even on two), as llama.cpp's
// row-by-row F16 dot products had suggested. A weight row reused by several x rows still pays for the wider tile.
// Each output runs the same K loop and reduction either way: the same bits.
template <typename T>
inline void linear_weight_rows(T* out, const T* x, const T* w, const T* bias, const LinearArgs& a, int64_t n_begin,
                               int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) linear_ntile<1>(out, x, w, bias, a, n);
}

// Rows of x per pass over the weight: 64 rows of K <= 4096 bf16 stay in L2 while the weight streams past.
constexpr int64_t kLinearMBlock = 64;

template <typename T>
void linear_rows_block(T* out, const T* x, const T* w, const T* bias, const LinearArgs& a) {
  constexpr int64_t NR = 4;
  const int64_t tiles = (a.N + NR - 1) / NR;
  // ~>= 256 KiB of weight per task, so small matrices run inline and big ones split across threads.
  const int64_t tile_bytes = NR * a.K * static_cast<int64_t>(sizeof(T));
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(tile_bytes, 1));
  pagellm::cpu::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NR;
      if (n0 + NR <= a.N && a.M > 1) {
        linear_ntile<NR>(out, x, w, bias, a, n0);
      } else {  // one x row (or the last rows): linear_weight_rows' sequential stream
        linear_weight_rows(out, x, w, bias, a, n0, std::min(n0 + NR, a.N));
      }
    }
  });
}

// Batch invariant: every (row, output) dot product runs the same K loop (one 16-lane accumulator, K in
// order, the same tail) and the same horizontal reduction whatever M is and wherever the row sits in an
// M tile or M block; tiles and blocks only decide how often a loaded weight row is reused.
template <typename T>
void linear_small_m_kernel(T* out, const T* x, const T* w, const T* bias, const LinearArgs& a) {
  for (int64_t m0 = 0; m0 < a.M; m0 += kLinearMBlock) {
    LinearArgs b = a;
    b.M = std::min(kLinearMBlock, a.M - m0);
    linear_rows_block(out + m0 * a.ldo, x + m0 * a.ldx, w, bias, b);
  }
}

}  // namespace pagellm::cpu
