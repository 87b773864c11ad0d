// x86 SIMD tiles of gguf_linear's small-M path, compiled per ISA with function `target` attributes so one
// build carries an AVX-512 and an AVX2 version whatever -march says (picked at run time, gguf_cpu_kernels.h).
//
// A tile is MR activation rows (fp32, L1-resident) against NR consecutive weight rows: every 32-element
// block of the NR rows is dequantized once in registers (exactly as gguf.quants does: d*q, d*(q-8) or
// d*q+m, each one rounding at most) and multiplied into MR x NR fp32 accumulators, so the weight bytes
// stream through once per MR rows. Only the tiles carry `target` (lambdas and generic callers would not
// inherit it); the drivers in gguf_cpu_kernels.h call them as functions, one call per tile.
#pragma once

#include <cstdint>
#include <cstring>

#include "ops/quant/gguf_blocks.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PAGELLM_GGUF_X86 1
#include <immintrin.h>

#define PAGELLM_GGUF_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define PAGELLM_GGUF_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PAGELLM_GGUF_INLINE inline __attribute__((always_inline))

namespace pagellm::cpu::gguf {
using namespace pagellm::gguf;

// x rows per tile, for NR = 4 weight rows: MR x NR accumulators must stay in registers.
constexpr int kAvx512MaxMR = 4;   // 16 zmm accumulators + 8 dequantized halves + 2 x
constexpr int kAvx2MaxMR = 2;     // 8 ymm accumulators + 4 dequantized quarters + 1 x

// ---------------------------------------------------------------- AVX-512: a block = 2 x 16 lanes
namespace avx512 {

// Block `blk` of type QT -> lo (elements 0..15), hi (16..31).
template <int QT>
PAGELLM_GGUF_AVX512 PAGELLM_GGUF_INLINE void dequant(const uint8_t* blk, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk)));
  if constexpr (QT == kQ8_0) {
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2)))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18)))), d);
  } else {
    constexpr int qs_offset = QT == kQ4_1 ? 4 : 2;
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + qs_offset)));
    const __m512 nlo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)));
    const __m512 nhi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    if constexpr (QT == kQ4_1) {
      const __m512 m = _mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2)));
      lo = _mm512_fmadd_ps(nlo, d, m);
      hi = _mm512_fmadd_ps(nhi, d, m);
    } else {  // d*q - 8d: both products exact, so one rounding like d*(q-8)
      const __m512 d8 = _mm512_mul_ps(d, _mm512_set1_ps(8.f));
      lo = _mm512_fmsub_ps(nlo, d, d8);
      hi = _mm512_fmsub_ps(nhi, d, d8);
    }
  }
}

// A k-quant super-block's parameters, unpacked once per (row, super-block) rather than per sub-block:
//   Q4_K p[s] = d sc[s], p[8 + s] = -(dmin mn[s]) for the 8 sub-blocks of 32;
//   Q6_K p[i] = d scales[i], p[16 + i] = -32 p[i] for the 16 groups of 16 (a (q - 32) = a q - 32 a: both products
//   exact, so one FMA rounds once, like numpy's a * (q - 32)).
template <int QT>
PAGELLM_GGUF_AVX512 PAGELLM_GGUF_INLINE void k_params(const uint8_t* blk, float* p) {
  if constexpr (QT == kQ4_K) {
    uint32_t u[3];  // the 12 scale bytes: sc / mn bits 0-5 of sub-blocks 0-3, then bits 0-3 of 4-7 (gguf_blocks.h)
    std::memcpy(u, blk + 4, 12);
    const uint32_t sc_hi = (u[2] & 0x0F0F0F0Fu) | ((u[0] >> 2) & 0x30303030u);  // bits 6-7 of byte i -> 4-5
    const uint32_t mn_hi = ((u[2] >> 4) & 0x0F0F0F0Fu) | ((u[1] >> 2) & 0x30303030u);
    const __m128i bytes = _mm_set_epi32(static_cast<int>(mn_hi), static_cast<int>(u[1] & 0x3F3F3F3Fu),
                                        static_cast<int>(sc_hi), static_cast<int>(u[0] & 0x3F3F3F3Fu));
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk)));
    const __m512 neg_dmin = _mm512_set1_ps(-_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2)));
    const __m512 factor = _mm512_mask_blend_ps(0xFF00, d, neg_dmin);
    _mm512_storeu_ps(p, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), factor));
  } else {
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 192))));
    const __m512 a = _mm512_mul_ps(sc, _mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 208))));
    _mm512_storeu_ps(p, a);
    _mm512_storeu_ps(p + 16, _mm512_mul_ps(a, _mm512_set1_ps(-32.f)));
  }
}

// 16 bytes at p -> 16 int32 lanes.
PAGELLM_GGUF_AVX512 PAGELLM_GGUF_INLINE __m512i bytes16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
}

// A k-quant block is dequantized in units that share their quant bytes: Q4_K 64 elements (sub-blocks 2u and
// 2u + 1: the low and high nibbles of 32 bytes), Q6_K 128 (half u: 64 ql bytes and 32 qh bytes).
template <int QT>
constexpr int kUnitVecs = QT == kQ4_K ? 4 : 8;  // 16-lane vectors per unit

// Unit u of k-quant block `blk`, its parameters p from k_params -> w[v] = elements 16 v .. 16 v + 15 of the unit.
// Callers unroll over u (a constant then).
template <int QT>
PAGELLM_GGUF_AVX512 PAGELLM_GGUF_INLINE void dequant_k_unit(const uint8_t* blk, const float* p, int u, __m512* w) {
  const __m512i low4 = _mm512_set1_epi32(0xF);
  if constexpr (QT == kQ4_K) {
    const uint8_t* qs = blk + 16 + 32 * u;
    for (int h = 0; h < 2; ++h) {
      const __m512i v = bytes16(qs + 16 * h);  // a q exact: one rounding per weight
      w[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low4)), _mm512_set1_ps(p[2 * u]),
                             _mm512_set1_ps(p[8 + 2 * u]));
      w[2 + h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), _mm512_set1_ps(p[2 * u + 1]),
                                 _mm512_set1_ps(p[8 + 2 * u + 1]));
    }
  } else {
    const uint8_t* ql = blk + 64 * u;
    const uint8_t* qh = blk + 128 + 32 * u;
    const __m512i bits45 = _mm512_set1_epi32(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m512i high = bytes16(qh + 16 * h);  // bit pair t holds bits 4-5 of element 32 t + 16 h + lane
      const __m512i high_at4[4] = {_mm512_slli_epi32(high, 4), _mm512_slli_epi32(high, 2), high,
                                   _mm512_srli_epi32(high, 2)};
      for (int c = 0; c < 2; ++c) {  // ql bytes 32 c + 16 h: element 32 c + 16 h (low nibble), 64 + ... (high)
        const __m512i l = bytes16(ql + 32 * c + 16 * h);
        for (int hi_nib = 0; hi_nib < 2; ++hi_nib) {
          const int t = 2 * hi_nib + c, g = 8 * u + 2 * t + h;  // quarter of the half; group of 16 in the block
          const __m512i lo = hi_nib ? _mm512_srli_epi32(l, 4) : _mm512_and_si512(l, low4);
          const __m512i q = _mm512_or_si512(lo, _mm512_and_si512(high_at4[t], bits45));
          w[2 * t + h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(p[g]), _mm512_set1_ps(p[16 + g]));
        }
      }
    }
  }
}

// The k-quant tile (same contract as `tile` below).
template <int QT, int MR, int NR>
PAGELLM_GGUF_AVX512 void k_tile(const uint8_t* w, int64_t ldw, const float* x, int64_t ldx, int64_t num_blocks,
                                float* sums, int64_t lds) {
  constexpr int kBytes = block_bytes(QT), kVecs = kUnitVecs<QT>, kUnits = kSuperElems / (16 * kVecs);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    alignas(64) float params[NR][32];
    for (int j = 0; j < NR; ++j) k_params<QT>(w + j * ldw + b * kBytes, params[j]);
#pragma GCC unroll 4
    for (int u = 0; u < kUnits; ++u) {
      for (int j = 0; j < NR; ++j) {
        __m512 wv[kVecs];
        dequant_k_unit<QT>(w + j * ldw + b * kBytes, params[j], u, wv);
        for (int i = 0; i < MR; ++i) {
          const float* xu = x + i * ldx + b * kSuperElems + 16 * kVecs * u;
          for (int v = 0; v < kVecs; ++v) acc[i][j] = _mm512_fmadd_ps(wv[v], _mm512_loadu_ps(xu + 16 * v), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i * lds + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// sums[i * lds + j] = x row i . weight row j, for i < MR, j < NR.
template <int QT, int MR, int NR>
PAGELLM_GGUF_AVX512 void tile(const uint8_t* w, int64_t ldw, const float* x, int64_t ldx, int64_t num_blocks,
                              float* sums, int64_t lds) {
  if constexpr (is_k_quant(QT)) {
    k_tile<QT, MR, NR>(w, ldw, x, ldx, num_blocks, sums, lds);
  } else {
    constexpr int kBytes = block_bytes(QT);
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
      __m512 lo[NR], hi[NR];
      for (int j = 0; j < NR; ++j) dequant<QT>(w + j * ldw + b * kBytes, lo[j], hi[j]);
      for (int i = 0; i < MR; ++i) {
        const __m512 x0 = _mm512_loadu_ps(x + i * ldx + b * 32), x1 = _mm512_loadu_ps(x + i * ldx + b * 32 + 16);
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(hi[j], x1, _mm512_fmadd_ps(lo[j], x0, acc[i][j]));
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) sums[i * lds + j] = _mm512_reduce_add_ps(acc[i][j]);
  }
}

// dst[0 : block_elems * nb] = the row's nb blocks dequantized (the GEMM path's tiles).
template <int QT>
PAGELLM_GGUF_AVX512 void dequant_row(const uint8_t* row, int64_t nb, float* dst) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * block_bytes(QT);
    float* out = dst + b * block_elems(QT);
    if constexpr (is_k_quant(QT)) {
      alignas(64) float params[32];
      k_params<QT>(blk, params);
      for (int u = 0; u < kSuperElems / (16 * kUnitVecs<QT>); ++u) {
        __m512 wv[kUnitVecs<QT>];
        dequant_k_unit<QT>(blk, params, u, wv);
        for (int v = 0; v < kUnitVecs<QT>; ++v) _mm512_storeu_ps(out + 16 * (kUnitVecs<QT> * u + v), wv[v]);
      }
    } else {
      __m512 lo, hi;
      dequant<QT>(blk, lo, hi);
      _mm512_storeu_ps(out, lo);
      _mm512_storeu_ps(out + 16, hi);
    }
  }
}

}  // namespace avx512

// ---------------------------------------------------------------- AVX2: a block = 4 x 8 lanes
namespace avx2 {

// The (a, b) parameters of sub-block s for the quarters below: d and m (Q4_1) or -8d (Q4_0, Q8_0: unused), or
// the k-quants' (a, b) of gguf_blocks.h.
template <int QT>
PAGELLM_GGUF_AVX2 PAGELLM_GGUF_INLINE void sub_params(const uint8_t* blk, int s, __m256& a, __m256& b) {
  if constexpr (QT == kQ4_K) {
    int sc, mn;
    q4k_scale_min(blk + 4, s, sc, mn);
    a = _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk)) * static_cast<float>(sc));
    b = _mm256_set1_ps(-(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2)) * static_cast<float>(mn)));
  } else if constexpr (QT == kQ6_K) {
    const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 208));
    const auto* scales = reinterpret_cast<const int8_t*>(blk + 192);
    a = _mm256_set1_ps(d * static_cast<float>(scales[2 * s]));
    b = _mm256_set1_ps(d * static_cast<float>(scales[2 * s + 1]));
  } else {
    a = _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk)));
    b = QT == kQ4_1 ? _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2)))
                    : _mm256_mul_ps(a, _mm256_set1_ps(-8.f));
  }
}

// 8 bytes at p -> 8 int32 lanes, each byte shifted right by `shift` and masked to `mask`.
PAGELLM_GGUF_AVX2 PAGELLM_GGUF_INLINE __m256i bits8(const uint8_t* p, int shift, int mask) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  return _mm256_and_si256(_mm256_srl_epi32(bytes, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(mask));
}

// Quarter q (elements 8q .. 8q+7) of sub-block s of block `blk`, its (a, b) from sub_params.
template <int QT>
PAGELLM_GGUF_AVX2 PAGELLM_GGUF_INLINE __m256 dequant_quarter(const uint8_t* blk, int s, int q, __m256 a, __m256 b) {
  if constexpr (QT == kQ8_0) {
    const __m128i b8 = _mm_loadl_epi64((const __m128i*)(blk + 2 + 8 * q));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8)), a);
  } else if constexpr (QT == kQ4_K) {
    const __m256i nib = bits8(blk + 16 + 32 * (s / 2) + 8 * q, 4 * (s & 1), 0xF);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(nib), a, b);
  } else if constexpr (QT == kQ6_K) {
    const __m256i lo4 = bits8(blk + 64 * (s / 4) + 32 * (s % 2) + 8 * q, 4 * ((s / 2) % 2), 0xF);
    const __m256i hi2 = bits8(blk + 128 + 32 * (s / 4) + 8 * q, 2 * (s % 4), 3);
    const __m256i v = _mm256_sub_epi32(_mm256_or_si256(lo4, _mm256_slli_epi32(hi2, 4)), _mm256_set1_epi32(32));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(v), q < 2 ? a : b);
  } else {
    constexpr int qs_offset = QT == kQ4_1 ? 4 : 2;
    const __m256i nib = bits8(blk + qs_offset + 8 * (q & 1), q < 2 ? 0 : 4, 0xF);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(nib), a, b);  // b = -8d for Q4_0 (exact, as above)
  }
}

template <int QT, int MR, int NR>
PAGELLM_GGUF_AVX2 void tile(const uint8_t* w, int64_t ldw, const float* x, int64_t ldx, int64_t num_blocks,
                            float* sums, int64_t lds) {
  constexpr int kBytes = block_bytes(QT), kElems = block_elems(QT);
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int s = 0; s < sub_blocks(QT); ++s) {
      __m256 pa[NR], pb[NR];
      for (int j = 0; j < NR; ++j) sub_params<QT>(w + j * ldw + b * kBytes, s, pa[j], pb[j]);
      for (int q = 0; q < 4; ++q) {
        __m256 wq[NR];
        for (int j = 0; j < NR; ++j) wq[j] = dequant_quarter<QT>(w + j * ldw + b * kBytes, s, q, pa[j], pb[j]);
        for (int i = 0; i < MR; ++i) {
          const __m256 xq = _mm256_loadu_ps(x + i * ldx + b * kElems + 32 * s + 8 * q);
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
// The generic drivers (gguf_cpu_kernels.h) call tiles through these; a tile is a real (not inlined) call,
// so the callers need no target attribute.
template <int QT, int MR, int NR>
struct Avx512Tile {
  using XType = float;
  static constexpr int kMaxMR = kAvx512MaxMR;
  static void run(const uint8_t* w, int64_t ldw, const float* x, int64_t ldx, int64_t nb, float* sums, int64_t lds) {
    avx512::tile<QT, MR, NR>(w, ldw, x, ldx, nb, sums, lds);
  }
};
template <int QT, int MR, int NR>
struct Avx2Tile {
  using XType = float;
  static constexpr int kMaxMR = kAvx2MaxMR;
  static void run(const uint8_t* w, int64_t ldw, const float* x, int64_t ldx, int64_t nb, float* sums, int64_t lds) {
    avx2::tile<QT, MR, NR>(w, ldw, x, ldx, nb, sums, lds);
  }
};

}  // namespace pagellm::cpu::gguf
#endif  // x86
