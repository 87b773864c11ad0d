// gguf_linear's row-interleaved ("packed") weight layout on the CPU and its AVX-512 VNNI small-M kernel.
//
// Why: in the file's layout every block carries its own fp16 scale next to its 16 / 32 quant bytes, so a
// one-row-at-a-time dot spends most of its instructions expanding scales into lanes (cvtph + permutes per
// block and row): the small-M kernel was compute-bound at ~1/3 of copy bandwidth. Packed, each int32 lane of a
// dot is one weight row: 16 rows' scales load as one vector, x's int8 quads are broadcast from memory, and a
// block of 16 rows costs ~30 instructions for 288-544 bytes (llama.cpp's repacked Q4_0x8 layouts, widened
// to 16 rows = one zmm of int32 lanes).
//
// Layout (qtype | kPackedFlag): the same [N, K / 32 * block_bytes] bytes; every full group of kPackRows = 16
// rows is rearranged block by block, the last N % 16 rows stay as in the file. For block b of a group, at
// byte b * 16 * block_bytes of the group:
//   [16 x fp16 d] (Q4_1: then [16 x fp16 m]), then the quant bytes in 64-byte chunks c, byte
//   c * 64 + r * 4 + t = row r's qs[4 c + t]  (Q8_0: 8 chunks, Q4_0 / Q4_1: 4 chunks of nibble pairs).
// python/pagellm/quantization/gguf_packing.py builds the same permutation (pack / unpack, tested against it).
#pragma once

#include <cstdint>
#include <cstring>

#include "ops/quant/gguf_blocks.h"
#include "ops/quant/gguf_cpu_vnni.h"

namespace pagellm::cpu::gguf {
using namespace pagellm::gguf;

constexpr int kPackRows = 16;

// Offset of the quant bytes in a packed block of 16 rows (after the scales).
constexpr int packed_qs_offset(int qt) { return qt == kQ4_1 ? 64 : 32; }
// Original offset of the quant bytes in one block.
constexpr int block_qs_offset(int qt) { return qt == kQ4_1 ? 4 : 2; }

// Row r (< N) of a packed weight, back in the file's layout, into dst[row_bytes].
inline void unpack_row(int qt, const uint8_t* w, int64_t N, int64_t row_bytes, int64_t r, uint8_t* dst) {
  const int64_t full = N / kPackRows * kPackRows;
  if (r >= full) {
    std::memcpy(dst, w + r * row_bytes, static_cast<size_t>(row_bytes));
    return;
  }
  const int bb = block_bytes(qt), j = static_cast<int>(r % kPackRows);
  const int qs_len = bb - block_qs_offset(qt), nchunks = qs_len / 4;
  const uint8_t* group = w + (r - j) * row_bytes;
  for (int64_t b = 0; b < row_bytes / bb; ++b) {
    const uint8_t* src = group + b * kPackRows * bb;
    uint8_t* out = dst + b * bb;
    std::memcpy(out, src + 2 * j, 2);                                  // d
    if (qt == kQ4_1) std::memcpy(out + 2, src + 32 + 2 * j, 2);        // m
    const uint8_t* qs = src + packed_qs_offset(qt);
    for (int c = 0; c < nchunks; ++c) std::memcpy(out + block_qs_offset(qt) + 4 * c, qs + c * 64 + 4 * j, 4);
  }
}

// Rows [n0, n0 + rows) of a packed weight in the file's layout, into dst [rows, row_bytes].
inline void unpack_rows(int qt, const uint8_t* w, int64_t N, int64_t row_bytes, int64_t n0, int64_t rows,
                        uint8_t* dst) {
  for (int64_t i = 0; i < rows; ++i) unpack_row(qt, w, N, row_bytes, n0 + i, dst + i * row_bytes);
}

#ifdef PAGELLM_GGUF_X86
namespace packed {

// x quantized per block for the packed kernel: [0, 32) int8 qx, [32, 36) fp32 dx, [36, 40) the correction:
// Q4_1 fp32 dx * sum(qx) (times m), Q4_0 int32 -8 * sum(qx), Q8_0 int32 -128 * sum(qx) (weights + 128).
constexpr int64_t kXBlockBytes = 40;

template <int QT>
PAGELLM_GGUF_VNNI void quantize_row(const float* x, int64_t nb, uint8_t* dst) {
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* out = dst + b * kXBlockBytes;
    int8_t* q = reinterpret_cast<int8_t*>(out);
    const float dx = vnni::quantize_block(x + b * 32, q);
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) sum += q[i];
    std::memcpy(out + 32, &dx, 4);
    if constexpr (QT == kQ4_1) {
      const float sx = dx * static_cast<float>(sum);
      std::memcpy(out + 36, &sx, 4);
    } else {
      const int32_t corr = -(QT == kQ8_0 ? 128 : 8) * sum;
      std::memcpy(out + 36, &corr, 4);
    }
  }
}

PAGELLM_GGUF_VNNI PAGELLM_GGUF_INLINE __m512i bcast_u32(const uint8_t* p) {
  return _mm512_set1_epi32(static_cast<int>(vnni::load_u32(p)));
}

PAGELLM_GGUF_VNNI PAGELLM_GGUF_INLINE float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// out[i * 16 + r] = quantized x row i . weight row r of one packed group, i < MR; x rows ldx bytes apart.
template <int QT, int MR>
PAGELLM_GGUF_VNNI void group_dot(const uint8_t* g, const uint8_t* x, int64_t ldx, int64_t nb, float* out) {
  constexpr int kBB = block_bytes(QT) * kPackRows;
  constexpr int kChunks = QT == kQ8_0 ? 8 : 4;
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = g + b * kBB;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * kBB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * kBB + 64), _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    __m512 m = _mm512_setzero_ps();
    if constexpr (QT == kQ4_1) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    const uint8_t* qs = blk + packed_qs_offset(QT);
    __m512i w[8];
    if constexpr (QT == kQ8_0) {
      for (int c = 0; c < 8; ++c) w[c] = _mm512_xor_si512(_mm512_loadu_si512(qs + c * 64), flip);
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m512i raw = _mm512_loadu_si512(qs + c * 64);
        w[c] = _mm512_and_si512(raw, nib);                          // elements 4c .. 4c + 3
        w[4 + c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);  // elements 16 + 4c ..
      }
    }
    for (int i = 0; i < MR; ++i) {
      const uint8_t* xb = x + i * ldx + b * kXBlockBytes;
      // Two dependency chains of dpbusd (their latency, not their count, would bound one chain).
      __m512i dot0 = QT == kQ4_1 ? _mm512_setzero_si512() : bcast_u32(xb + 36), dot1 = _mm512_setzero_si512();
      if constexpr (QT == kQ8_0) {
        for (int c = 0; c < kChunks; c += 2) {
          dot0 = _mm512_dpbusd_epi32(dot0, w[c], bcast_u32(xb + 4 * c));
          dot1 = _mm512_dpbusd_epi32(dot1, w[c + 1], bcast_u32(xb + 4 * c + 4));
        }
      } else {
        for (int c = 0; c < kChunks; ++c) {
          dot0 = _mm512_dpbusd_epi32(dot0, w[c], bcast_u32(xb + 4 * c));
          dot1 = _mm512_dpbusd_epi32(dot1, w[4 + c], bcast_u32(xb + 16 + 4 * c));
        }
      }
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(load_f32(xb + 32)));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot0, dot1)), scale, acc[i]);
      if constexpr (QT == kQ4_1) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(load_f32(xb + 36)), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(out + i * kPackRows, acc[i]);
}

// out[i * 16 + r] for i < M (any M): groups of up to 4 x rows, the packed group re-read from L1.
template <int QT>
PAGELLM_GGUF_VNNI void group_dot_m(const uint8_t* g, const uint8_t* x, int64_t ldx, int64_t M, int64_t nb,
                                   float* out) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) group_dot<QT, 4>(g, x + i * ldx, ldx, nb, out + i * kPackRows);
  switch (M - i) {
    case 3: group_dot<QT, 3>(g, x + i * ldx, ldx, nb, out + i * kPackRows); break;
    case 2: group_dot<QT, 2>(g, x + i * ldx, ldx, nb, out + i * kPackRows); break;
    case 1: group_dot<QT, 1>(g, x + i * ldx, ldx, nb, out + i * kPackRows); break;
    default: break;
  }
}

}  // namespace packed
#endif  // PAGELLM_GGUF_X86

}  // namespace pagellm::cpu::gguf
