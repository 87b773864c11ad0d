// x86 SIMD tiles of awq_linear's small-M path, compiled per ISA with function `target` attributes so one
// build carries an AVX-512 and an AVX2 version whatever -march says (picked at run time, awq_cpu_kernels.h).
//
// A tile is MR activation rows (fp32, L1-resident) against NR consecutive weight rows. Per group the NR
// scales and zero points are broadcast once; every 16-byte block of the NR rows is expanded in registers
// (bytes -> int32 nibbles, minus the zero point, -> float, times the scale: exact up to that one product)
// and multiplied into MR x NR fp32 accumulators, so the weight bytes stream through once per MR rows. Only
// the tiles carry `target`; the generic drivers call them as functions, one call per tile.
#pragma once

#include <cstdint>

#include "ops/quant/awq_layout.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PAGELLM_AWQ_X86 1
#include <immintrin.h>

#define PAGELLM_AWQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define PAGELLM_AWQ_AVX2 __attribute__((target("avx2,fma")))
#define PAGELLM_AWQ_INLINE inline __attribute__((always_inline))

namespace pagellm::cpu::awq {
using namespace pagellm::awq;

// x rows per tile, for NR = 4 weight rows: the MR x NR accumulators must stay in registers.
constexpr int kAvx512MaxMR = 4;  // 16 zmm accumulators + 8 dequantized halves + 2 x (scales / zeros reloaded)
constexpr int kAvx2MaxMR = 2;    // 8 ymm accumulators + 4 dequantized quarters + 1 x

// ---------------------------------------------------------------- AVX-512: a block = 2 x 16 lanes
namespace avx512 {

// The block at `blk` -> lo (elements 0..15), hi (16..31) as (q - z) * s.
PAGELLM_AWQ_AVX512 PAGELLM_AWQ_INLINE void dequant(const uint8_t* blk, __m512i z, __m512 s, __m512& lo, __m512& hi) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  const __m512i qlo = _mm512_sub_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), z);
  const __m512i qhi = _mm512_sub_epi32(_mm512_srli_epi32(bytes, 4), z);
  lo = _mm512_mul_ps(_mm512_cvtepi32_ps(qlo), s);
  hi = _mm512_mul_ps(_mm512_cvtepi32_ps(qhi), s);
}

// sums[i * lds + j] = x row i . weight row j, for i < MR, j < NR (x rows ldx floats apart).
template <int MR, int NR>
PAGELLM_AWQ_AVX512 void tile(const AwqWeightView& w, const float* x, int64_t ldx, float* sums, int64_t lds) {
  const int64_t ldq = w.row_bytes(), ldg = w.num_groups(), bpg = w.blocks_per_group();
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ldg; ++g) {
    __m512i z[NR];
    __m512 s[NR];
    for (int j = 0; j < NR; ++j) {
      z[j] = _mm512_set1_epi32(w.zeros[j * ldg + g]);
      s[j] = _mm512_set1_ps(w.scales[j * ldg + g]);
    }
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      __m512 lo[NR], hi[NR];
      for (int j = 0; j < NR; ++j) dequant(w.qweight + j * ldq + b * kBlockBytes, z[j], s[j], lo[j], hi[j]);
      for (int i = 0; i < MR; ++i) {
        const float* xb = x + i * ldx + b * kBlockElems;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(hi[j], x1, _mm512_fmadd_ps(lo[j], x0, acc[i][j]));
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i * lds + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// dst[0 : K] = weight row 0 of `w` dequantized (the GEMM path's tiles).
PAGELLM_AWQ_AVX512 inline void dequant_row(const AwqWeightView& w, float* dst) {
  const int64_t bpg = w.blocks_per_group();
  for (int64_t g = 0; g < w.num_groups(); ++g) {
    const __m512i z = _mm512_set1_epi32(w.zeros[g]);
    const __m512 s = _mm512_set1_ps(w.scales[g]);
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      __m512 lo, hi;
      dequant(w.qweight + b * kBlockBytes, z, s, lo, hi);
      _mm512_storeu_ps(dst + b * kBlockElems, lo);
      _mm512_storeu_ps(dst + b * kBlockElems + 16, hi);
    }
  }
}

}  // namespace avx512

// ---------------------------------------------------------------- AVX2: a block = 4 x 8 lanes
namespace avx2 {

// Quarter qr (elements 8 qr .. 8 qr + 7) of the block at `blk`, as (q - z) * s.
PAGELLM_AWQ_AVX2 PAGELLM_AWQ_INLINE __m256 dequant_quarter(const uint8_t* blk, int qr, __m256i z, __m256 s) {
  const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 8 * (qr & 1)));
  const __m256i bytes = _mm256_cvtepu8_epi32(b8);
  const __m256i nib = qr < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(bytes, 4);
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(nib, z)), s);
}

template <int MR, int NR>
PAGELLM_AWQ_AVX2 void tile(const AwqWeightView& w, const float* x, int64_t ldx, float* sums, int64_t lds) {
  const int64_t ldq = w.row_bytes(), ldg = w.num_groups(), bpg = w.blocks_per_group();
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ldg; ++g) {
    __m256i z[NR];
    __m256 s[NR];
    for (int j = 0; j < NR; ++j) {
      z[j] = _mm256_set1_epi32(w.zeros[j * ldg + g]);
      s[j] = _mm256_set1_ps(w.scales[j * ldg + g]);
    }
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      for (int qr = 0; qr < 4; ++qr) {
        __m256 wq[NR];
        for (int j = 0; j < NR; ++j) wq[j] = dequant_quarter(w.qweight + j * ldq + b * kBlockBytes, qr, z[j], s[j]);
        for (int i = 0; i < MR; ++i) {
          const __m256 xq = _mm256_loadu_ps(x + i * ldx + b * kBlockElems + 8 * qr);
          for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(wq[j], xq, acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[i][j]), _mm256_extractf128_ps(acc[i][j], 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      sums[i * lds + j] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
    }
}

}  // namespace avx2

// ---------------------------------------------------------------- tile functors
// The generic drivers (awq_cpu_kernels.h) call tiles through these; a tile is a real (not inlined) call,
// so the callers need no target attribute.
template <int MR, int NR>
struct Avx512Tile {
  static constexpr int kMaxMR = kAvx512MaxMR;
  static void run(const AwqWeightView& w, const float* x, int64_t ldx, float* sums, int64_t lds) {
    avx512::tile<MR, NR>(w, x, ldx, sums, lds);
  }
};
template <int MR, int NR>
struct Avx2Tile {
  static constexpr int kMaxMR = kAvx2MaxMR;
  static void run(const AwqWeightView& w, const float* x, int64_t ldx, float* sums, int64_t lds) {
    avx2::tile<MR, NR>(w, x, ldx, sums, lds);
  }
};

}  // namespace pagellm::cpu::awq
#endif  // x86
