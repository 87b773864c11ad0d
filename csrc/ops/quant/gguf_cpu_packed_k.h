// The row-packed layout's AVX-512 VNNI kernels for the k-quants (Q4_K, Q6_K: 256-element super-blocks), and
// the small-M driver's per-group dispatch over every packed type.
//
// A packed super-block of 16 rows (gguf_cpu_packed.h) holds each row's scale fields as int32 lanes (Q4_K's 12
// scale bytes as 3 quads, Q6_K's 16 int8 scales as 4), so the per-sub-block scales of all 16 rows come out of a
// few shifts and masks of one vector, with no per-row work; the quant quads feed vpdpbusd as for Q4_1. x is
// quantized per 32-block (packed::quantize_row): the integer dots are the file-layout VNNI tiles' (same qx, same
// weights), only the fp32 accumulation order differs.
//   Q4_K  sub-block s = 2u + h (u = s / 2): quads 8u .. 8u + 7 of qs, low nibbles (h = 0) or high (h = 1);
//         w = a q + b with a = d sc[s], b = -dmin mn[s]: acc += a dx (q . qx) + b (dx sum qx)
//   Q6_K  sub-block s, quarter t = s / 2 % 2 of half h = s / 4: ql quads 16h + 8 (s % 2) + e4 (nibble t), qh quads
//         8h + e4 (bits 2 (s % 4)); a scale per 16 elements: acc += d scales[g] dx (q . qx - 32 sum qx)
#pragma once

#include <cstdint>

#include "ops/quant/gguf_cpu_packed.h"

#ifdef PAGELLM_GGUF_X86
namespace pagellm::cpu::gguf::packed {

// Byte i of every int32 lane of v (as int32).
PAGELLM_GGUF_VNNI PAGELLM_GGUF_INLINE __m512i lane_byte(__m512i v, int i) {
  return _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(8 * i)), _mm512_set1_epi32(0xFF));
}

// out[i * 16 + r] = quantized x row i . weight row r of one packed Q4_K group, i < MR; nsb super-blocks.
template <int MR>
PAGELLM_GGUF_VNNI void q4_k_group_dot(const uint8_t* g, const uint8_t* x, int64_t ldx, int64_t nsb, float* out) {
  constexpr int kBB = block_bytes(kQ4_K) * kPackRows;
  constexpr int64_t kXB = x_block_bytes<kQ4_K>();
  constexpr int kScales = packed_field_offset(kQ4_K, 2), kQs = packed_field_offset(kQ4_K, 3);
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F), low6 = _mm512_set1_epi32(0x3F3F3F3F);
  const __m512i low4 = _mm512_set1_epi32(0x0F0F0F0F), bits45 = _mm512_set1_epi32(0x30303030);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* blk = g + sb * kBB;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    // Per row, as k_params unpacks them: sc / mn of sub-blocks 0-3 and 4-7, one byte each.
    const __m512i u0 = _mm512_loadu_si512(blk + kScales), u1 = _mm512_loadu_si512(blk + kScales + 64);
    const __m512i u2 = _mm512_loadu_si512(blk + kScales + 128);
    const __m512i sc[2] = {_mm512_and_si512(u0, low6),
                           _mm512_or_si512(_mm512_and_si512(u2, low4),
                                           _mm512_and_si512(_mm512_srli_epi32(u0, 2), bits45))};
    const __m512i mn[2] = {_mm512_and_si512(u1, low6),
                           _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), low4),
                                           _mm512_and_si512(_mm512_srli_epi32(u1, 2), bits45))};
    const uint8_t* qs = blk + kQs;
    for (int s = 0; s < 8; ++s) {
      for (int k = 0; k < 5; ++k) {  // the next super-block's 36 lines, 5 per sub-block
        _mm_prefetch(reinterpret_cast<const char*>(blk + kBB + 64 * (5 * s + k)), _MM_HINT_T0);
      }
      // Odd sub-blocks are the high nibbles, taken in place (16 q: exact in the int32 dot and its fp32
      // conversion) with a / 16 (exact): the same products as shifting them down.
      const __m512 a = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(s % 2 ? 1.f / 16 : 1.f)),
                                     _mm512_cvtepi32_ps(lane_byte(sc[s / 4], s % 4)));
      const __m512 bneg = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(lane_byte(mn[s / 4], s % 4)));  // -b
      const __m512i mask = s % 2 ? _mm512_set1_epi8(static_cast<char>(0xF0)) : nib;
      __m512i w[8];
      for (int e = 0; e < 8; ++e) w[e] = _mm512_and_si512(_mm512_loadu_si512(qs + (8 * (s / 2) + e) * 64), mask);
      for (int i = 0; i < MR; ++i) {
        const uint8_t* xb = x + i * ldx + (8 * sb + s) * kXB;
        __m512i dot = _mm512_setzero_si512();
        for (int e = 0; e < 8; ++e) dot = _mm512_dpbusd_epi32(dot, w[e], bcast_u32(xb + 4 * e));
        const __m512 dx = _mm512_set1_ps(load_f32(xb + 32));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(a, dx), acc[i]);
        acc[i] = _mm512_fnmadd_ps(bneg, _mm512_set1_ps(load_f32(xb + 36)), acc[i]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(out + i * kPackRows, acc[i]);
}

// The same for one packed Q6_K group.
template <int MR>
PAGELLM_GGUF_VNNI void q6_k_group_dot(const uint8_t* g, const uint8_t* x, int64_t ldx, int64_t nsb, float* out) {
  constexpr int kBB = block_bytes(kQ6_K) * kPackRows;
  constexpr int64_t kXB = x_block_bytes<kQ6_K>();
  constexpr int kScales = packed_field_offset(kQ6_K, 1), kQl = packed_field_offset(kQ6_K, 2);
  constexpr int kQh = packed_field_offset(kQ6_K, 3);
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* blk = g + sb * kBB;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    for (int s = 0; s < 8; ++s) {
      for (int k = 0; k < 7; ++k) {  // the next super-block's 53 lines, 7 per sub-block
        _mm_prefetch(reinterpret_cast<const char*>(blk + kBB + 64 * (7 * s + k)), _MM_HINT_T0);
      }
      // scales 2s and 2s + 1: bytes 2 (s % 2), + 1 of quad s / 2, sign-extended
      const __m512i quad = _mm512_loadu_si512(blk + kScales + 64 * (s / 2));
      const int shift = 16 * (s % 2);
      const __m512i sc0 = _mm512_srai_epi32(_mm512_sll_epi32(quad, _mm_cvtsi32_si128(24 - shift)), 24);
      const __m512i sc1 = _mm512_srai_epi32(_mm512_sll_epi32(quad, _mm_cvtsi32_si128(16 - shift)), 24);
      const __m512 a0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc0)), a1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc1));
      const uint8_t* ql = blk + kQl + (16 * (s / 4) + 8 * (s % 2)) * 64;
      const uint8_t* qh = blk + kQh + 8 * (s / 4) * 64;
      // ql's nibble s / 2 % 2 down to bits 0-3; qh's bits 2 (s % 4), + 1 to bits 4, 5 by rotating each int32 lane
      // left by 4 - 2 (s % 4) (mod 32): what wraps around or crosses bytes lands outside bits 4, 5 and is masked.
      const __m128i ql_shift = _mm_cvtsi32_si128(4 * (s / 2 % 2));
      const __m512i qh_rot = _mm512_set1_epi32((4 - 2 * (s % 4)) & 31);
      const __m512i bits45 = _mm512_set1_epi8(0x30);
      __m512i w[8];
      for (int e = 0; e < 8; ++e) {
        const __m512i lo = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(ql + 64 * e), ql_shift), nib);
        const __m512i hi = _mm512_rolv_epi32(_mm512_loadu_si512(qh + 64 * e), qh_rot);
        w[e] = _mm512_or_si512(lo, _mm512_and_si512(hi, bits45));
      }
      for (int i = 0; i < MR; ++i) {
        const uint8_t* xb = x + i * ldx + (8 * sb + s) * kXB;
        __m512i dot0 = _mm512_set1_epi32(static_cast<int>(vnni::load_u32(xb + 36)));  // -32 sum qx[0:16]
        __m512i dot1 = _mm512_set1_epi32(static_cast<int>(vnni::load_u32(xb + 40)));  // -32 sum qx[16:32]
        for (int e = 0; e < 4; ++e) {
          dot0 = _mm512_dpbusd_epi32(dot0, w[e], bcast_u32(xb + 4 * e));
          dot1 = _mm512_dpbusd_epi32(dot1, w[4 + e], bcast_u32(xb + 16 + 4 * e));
        }
        const __m512 part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), a0,
                                            _mm512_mul_ps(_mm512_cvtepi32_ps(dot1), a1));
        acc[i] = _mm512_fmadd_ps(part, _mm512_set1_ps(load_f32(xb + 32)), acc[i]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(out + i * kPackRows, acc[i]);
}

template <int QT, int MR>
PAGELLM_GGUF_VNNI PAGELLM_GGUF_INLINE void any_group_dot(const uint8_t* g, const uint8_t* x, int64_t ldx, int64_t nb,
                                                          float* out) {
  if constexpr (QT == kQ4_K) {
    q4_k_group_dot<MR>(g, x, ldx, nb, out);
  } else if constexpr (QT == kQ6_K) {
    q6_k_group_dot<MR>(g, x, ldx, nb, out);
  } else {
    group_dot<QT, MR>(g, x, ldx, nb, out);
  }
}

// out[i * 16 + r] for i < M (any M): groups of up to 4 x rows, the packed group re-read from L1. nb: blocks of
// QT per row (super-blocks for the k-quants).
template <int QT>
PAGELLM_GGUF_VNNI void group_dot_m(const uint8_t* g, const uint8_t* x, int64_t ldx, int64_t M, int64_t nb,
                                   float* out) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) any_group_dot<QT, 4>(g, x + i * ldx, ldx, nb, out + i * kPackRows);
  switch (M - i) {
    case 3: any_group_dot<QT, 3>(g, x + i * ldx, ldx, nb, out + i * kPackRows); break;
    case 2: any_group_dot<QT, 2>(g, x + i * ldx, ldx, nb, out + i * kPackRows); break;
    case 1: any_group_dot<QT, 1>(g, x + i * ldx, ldx, nb, out + i * kPackRows); break;
    default: break;
  }
}

}  // namespace pagellm::cpu::gguf::packed
#endif  // PAGELLM_GGUF_X86
