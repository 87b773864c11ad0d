// AVX-512 VNNI tiles of gguf_linear's small-M path for half-precision (bf16 / fp16) activations, the way
// llama.cpp multiplies GGUF blocks: x is quantized per 32-element block to int8 (scale dx = max|x| / 127,
// q = round(x / dx)) once per call, and each pair of weight blocks meets it in one `vpdpbusd` (64 u8 x s8
// products summed in fourths into 16 int32 lanes), scaled by d * dx in fp32:
//   Q4_0  sum d (q - 8) x = d dx (sum q qx - 8 sum qx)         (the -8 sum qx term preloaded into the dot)
//   Q8_0  sum d q x      = d dx (sum (q + 128) qx - 128 sum qx) (q + 128: vpdpbusd wants unsigned weights)
//   Q4_1  sum (d q + m) x = d dx sum q qx + m dx sum qx
//   Q4_K  per pair of sub-blocks (2u, 2u + 1: the low and high nibbles of 32 bytes), as Q4_1 with a = d sc and
//         b = -dmin mn of each sub-block (k_params) in place of d and m
//   Q6_K  per pair of sub-blocks (64 consecutive elements: 64 ql nibbles and 2 bits from each of 32 qh bytes),
//         sum a (q - 32) x = dx sum_groups a_g (sum q qx - 32 sum qx), one scale a_g per 16 elements = 4 lanes
// The int8 rounding of x (relative error ~0.4% of each block's largest |x|) is of the order of bf16's own
// rounding of the output; fp32 activations never take this path (they get the exact FMA tiles).
//
// Quantized x, per row, per pair of blocks p (the last pair zero-padded when K / 32 is odd), kPairBytes bytes:
//   [0, 64)    qx, int8, in the order the pair's weight bytes are expanded: Q8_0, Q4_K, Q6_K [x0[0:32] | x1[0:32]],
//              Q4_0/Q4_1 [x0[0:16] | x1[0:16] | x0[16:32] | x1[16:32]] (low nibbles, then high nibbles)
//   [64, 128)  dx of the block each int32 lane of the dot belongs to (16 floats)
//   [128, 192) Q4_0/Q6_K/Q8_0: -8 / -32 / -128 x the lane's sum of qx (16 int32, the dot's initial value);
//              Q4_1, Q4_K: dx x the lane's sum of qx (16 floats, multiplied by m / b)
#pragma once

#include <cstdint>
#include <cstring>

#include "ops/quant/gguf_cpu_simd.h"

#ifdef PAGELLM_GGUF_X86
#define PAGELLM_GGUF_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

namespace pagellm::cpu::gguf {
namespace vnni {

constexpr int64_t kPairBytes = 192;
constexpr int kMaxMR = 4;

// Which block of the pair (0 / 1) each int32 lane of a dot belongs to.
template <int QT>
PAGELLM_GGUF_VNNI PAGELLM_GGUF_INLINE __m512i lane_block() {
  return QT == kQ8_0 || is_k_quant(QT) ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                     : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
}

// One block of x (32 floats) -> q[0:32] int8 and its scale.
PAGELLM_GGUF_VNNI PAGELLM_GGUF_INLINE float quantize_block(const float* x, int8_t* q) {
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float dx = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(dx != 0.f ? 1.f / dx : 0.f);
  _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inv))));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, inv))));
  return dx;
}

// x row [nb * 32] fp32 -> its quantized form (layout above), (nb + 1) / 2 pairs at dst.
template <int QT>
PAGELLM_GGUF_VNNI void quantize_row(const float* x, int64_t nb, uint8_t* dst) {
  for (int64_t p = 0; p < (nb + 1) / 2; ++p) {
    alignas(64) int8_t q[2][32] = {};
    float dx[2] = {0.f, 0.f};
    for (int h = 0; h < 2 && 2 * p + h < nb; ++h) dx[h] = quantize_block(x + (2 * p + h) * 32, q[h]);
    uint8_t* out = dst + p * kPairBytes;
    if constexpr (QT == kQ8_0 || is_k_quant(QT)) {
      std::memcpy(out, q[0], 32);
      std::memcpy(out + 32, q[1], 32);
    } else {
      std::memcpy(out, q[0], 16);
      std::memcpy(out + 16, q[1], 16);
      std::memcpy(out + 32, q[0] + 16, 16);
      std::memcpy(out + 48, q[1] + 16, 16);
    }
    const __m512i qx = _mm512_loadu_si512(out);
    const __m512 dxv = _mm512_permutexvar_ps(lane_block<QT>(), _mm512_set_ps(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                               0, dx[1], dx[0]));
    const __m512i lane_sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), qx);
    _mm512_storeu_ps(out + 64, dxv);
    if constexpr (QT == kQ4_1 || QT == kQ4_K) {
      _mm512_storeu_ps(out + 128, _mm512_mul_ps(dxv, _mm512_cvtepi32_ps(lane_sum)));
    } else {
      _mm512_storeu_si512(out + 128, _mm512_slli_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), lane_sum),
                                                       QT == kQ8_0 ? 7 : QT == kQ6_K ? 5 : 3));
    }
  }
}

PAGELLM_GGUF_VNNI PAGELLM_GGUF_INLINE uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Weight blocks b0 and b1 (b1 == b0 for the padding half of a last, odd pair) -> their bytes expanded in
// qx's order (Q4 nibbles / Q8_0 values + 128, as unsigned), d per lane, and for Q4_1 m per lane.
template <int QT>
PAGELLM_GGUF_VNNI PAGELLM_GGUF_INLINE void weight_pair(const uint8_t* b0, const uint8_t* b1, __m512i& wq, __m512& dv,
                                                       __m512& mv) {
  const __m512i lanes = lane_block<QT>();
  if constexpr (QT == kQ8_0) {
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b0 + 2))),
                                         _mm256_loadu_si256((const __m256i*)(b1 + 2)), 1);
    wq = _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>((load_u32(b0) & 0xFFFF) | (load_u32(b1) << 16))));
    dv = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(d));
    mv = _mm512_setzero_ps();  // unused
  } else {
    constexpr int qs = QT == kQ4_1 ? 4 : 2;
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(b0 + qs))),
                                              _mm_loadu_si128((const __m128i*)(b1 + qs)), 1);
    wq = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1),
                          _mm512_set1_epi8(0x0F));
    if constexpr (QT == kQ4_1) {  // [d0, m0, d1, m1]
      const __m128 dm = _mm_cvtph_ps(_mm_set_epi32(0, 0, static_cast<int>(load_u32(b1)), static_cast<int>(load_u32(b0))));
      const __m512i twice = _mm512_add_epi32(lanes, lanes);
      dv = _mm512_permutexvar_ps(twice, _mm512_castps128_ps512(dm));
      mv = _mm512_permutexvar_ps(_mm512_add_epi32(twice, _mm512_set1_epi32(1)), _mm512_castps128_ps512(dm));
    } else {
      const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>((load_u32(b0) & 0xFFFF) | (load_u32(b1) << 16))));
      dv = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(d));
      mv = _mm512_setzero_ps();  // unused
    }
  }
}

// sums[i * lds + j] = quantized x row i . weight row j, i < MR, j < NR; x rows ldx bytes apart.
template <int QT, int MR, int NR>
PAGELLM_GGUF_VNNI void tile(const uint8_t* w, int64_t ldw, const uint8_t* x, int64_t ldx, int64_t nb, float* sums,
                            int64_t lds) {
  constexpr int kBytes = block_bytes(QT);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < (nb + 1) / 2; ++p) {
    const int64_t step = 2 * p + 1 < nb ? kBytes : 0;
    __m512i wq[NR];
    __m512 dv[NR], mv[NR];
    for (int j = 0; j < NR; ++j) {
      const uint8_t* b0 = w + j * ldw + 2 * p * kBytes;
      weight_pair<QT>(b0, b0 + step, wq[j], dv[j], mv[j]);
    }
    for (int i = 0; i < MR; ++i) {
      const uint8_t* xp = x + i * ldx + p * kPairBytes;
      const __m512i qx = _mm512_loadu_si512(xp);
      const __m512 dxv = _mm512_loadu_ps(xp + 64);
      for (int j = 0; j < NR; ++j) {
        if constexpr (QT == kQ4_1) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[j], qx);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv[j], dxv), acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(mv[j], _mm512_loadu_ps(xp + 128), acc[i][j]);
        } else {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(xp + 128), wq[j], qx);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv[j], dxv), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i * lds + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// The Q4_K tile: nb super-blocks per row, x quantized by quantize_row<kQ4_K> (4 pairs per super-block).
template <int MR, int NR>
PAGELLM_GGUF_VNNI void q4_k_tile(const uint8_t* w, int64_t ldw, const uint8_t* x, int64_t ldx, int64_t nb,
                                 float* sums, int64_t lds) {
  constexpr int kBytes = block_bytes(kQ4_K);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    alignas(64) float params[NR][32];  // a[0:8], b[8:16] per row
    for (int j = 0; j < NR; ++j) avx512::k_params<kQ4_K>(w + j * ldw + b * kBytes, params[j]);
    for (int u = 0; u < 4; ++u) {
      for (int j = 0; j < NR; ++j) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + j * ldw + b * kBytes + 16 + 32 * u));
        const __m512i wq = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1),
                                            _mm512_set1_epi8(0x0F));
        const float* p = params[j];
        const __m512 av = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(p[2 * u]), _mm512_set1_ps(p[2 * u + 1]));
        const __m512 bv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(p[8 + 2 * u]), _mm512_set1_ps(p[9 + 2 * u]));
        for (int i = 0; i < MR; ++i) {
          const uint8_t* xp = x + i * ldx + (4 * b + u) * kPairBytes;
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, _mm512_loadu_si512(xp));
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(av, _mm512_loadu_ps(xp + 64)), acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(bv, _mm512_loadu_ps(xp + 128), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i * lds + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// The Q6_K tile (same contract as q4_k_tile).
template <int MR, int NR>
PAGELLM_GGUF_VNNI void q6_k_tile(const uint8_t* w, int64_t ldw, const uint8_t* x, int64_t ldx, int64_t nb,
                                 float* sums, int64_t lds) {
  constexpr int kBytes = block_bytes(kQ6_K);
  const __m512i group_of_lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    alignas(64) float params[NR][32];  // a per group of 16 elements: [0:16]
    for (int j = 0; j < NR; ++j) avx512::k_params<kQ6_K>(w + j * ldw + b * kBytes, params[j]);
    for (int u = 0; u < 4; ++u) {  // elements 64 u ..: quarters t = 2 (u % 2), + 1 of half u / 2
      const int t0 = 2 * (u % 2);
      for (int j = 0; j < NR; ++j) {
        const uint8_t* blk = w + j * ldw + b * kBytes;
        const __m512i ql = _mm512_loadu_si512(blk + 64 * (u / 2));
        const __m512i low4 = _mm512_and_si512(u % 2 ? _mm512_srli_epi16(ql, 4) : ql, _mm512_set1_epi8(0x0F));
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * (u / 2)));
        const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t0))),
                                               _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t0 + 2)), 1);
        const __m512i wq = _mm512_or_si512(low4, _mm512_slli_epi16(_mm512_and_si512(qh2, _mm512_set1_epi8(3)), 4));
        const __m512 av = _mm512_permutexvar_ps(group_of_lane, _mm512_castps128_ps512(_mm_loadu_ps(params[j] + 4 * u)));
        for (int i = 0; i < MR; ++i) {
          const uint8_t* xp = x + i * ldx + (4 * b + u) * kPairBytes;
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(xp + 128), wq, _mm512_loadu_si512(xp));
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(av, _mm512_loadu_ps(xp + 64)), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i * lds + j] = _mm512_reduce_add_ps(acc[i][j]);
}

}  // namespace vnni

// Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K.
template <int QT, int MR, int NR>
struct VnniTile {
  using XType = uint8_t;  // x quantized by vnni::quantize_row
  static constexpr int kMaxMR = vnni::kMaxMR;
  static void run(const uint8_t* w, int64_t ldw, const uint8_t* x, int64_t ldx, int64_t nb, float* sums, int64_t lds) {
    if constexpr (QT == kQ4_K) {
      vnni::q4_k_tile<MR, NR>(w, ldw, x, ldx, nb, sums, lds);
    } else if constexpr (QT == kQ6_K) {
      vnni::q6_k_tile<MR, NR>(w, ldw, x, ldx, nb, sums, lds);
    } else {
      vnni::tile<QT, MR, NR>(w, ldw, x, ldx, nb, sums, lds);
    }
  }
};

}  // namespace pagellm::cpu::gguf
#endif  // PAGELLM_GGUF_X86
