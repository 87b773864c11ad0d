// gguf_linear's row-interleaved ("packed") weight layout on the CPU and its AVX-512 VNNI small-M kernel.
//
// Why: in the file's layout every block carries its own fp16 scale next to its 16 / 32 quant bytes, so a
// one-row-at-a-time dot spends most of its instructions expanding scales into lanes (cvtph + permutes per
// block and row): the small-M kernel was compute-bound at ~1/3 of copy bandwidth. Packed, each int32 lane of a
// dot is one weight row: 16 rows' scales load as one vector, x's int8 quads are broadcast from memory, and a
// block of 16 rows costs ~30 instructions for 288-544 bytes (llama.cpp's repacked Q4_0x8 layouts, widened
// to 16 rows = one zmm of int32 lanes).
//
// Layout (qtype | kPackedFlag): the same [N, row_bytes] bytes, moved (none changed); every full group of
// kPackRows = 16 rows is rearranged block by block, the last N % 16 rows stay as in the file. A block is a list
// of fields (packed_fields: offset and length in the file's block, unit 2 for an fp16, 4 for a quad of quant or
// scale bytes); block b of a group sits at byte b * 16 * block_bytes of the group, its fields one after another
// in that order, each as [unit u][row r][unit bytes], so one 64-byte chunk of a quad field holds quad u of all
// 16 rows (an int32 lane per row). Per type (offsets within the packed block of 16 rows):
//   Q8_0 / Q4_0  [16 x fp16 d] at 0, qs quads at 32 (8 / 4 chunks)
//   Q4_1         d at 0, [16 x fp16 m] at 32, qs quads at 64 (4 chunks)
//   Q4_K         d at 0, dmin at 32, the 12 scale bytes as 3 chunks at 64, qs quads at 256 (32 chunks)
//   Q6_K         d at 0, the 16 int8 scales as 4 chunks at 32, ql quads at 288 (32), qh quads at 2336 (16)
// python/pagellm/quantization/gguf_packing.py builds the same permutation (pack / unpack, tested against it).
#pragma once

#include <cstdint>
#include <cstring>

#include "ops/quant/gguf_blocks.h"
#include "ops/quant/gguf_cpu_vnni.h"

namespace pagellm::cpu::gguf {
using namespace pagellm::gguf;

constexpr int kPackRows = 16;

// One field of a block as the packed layout moves it: `bytes` bytes at `offset` in the file's block, in units of
// `unit` bytes.
struct PackedField {
  int offset, bytes, unit;
};
struct PackedFields {
  int count;
  PackedField f[4];
};

constexpr PackedFields packed_fields(int qt) {
  switch (qt) {
    case kQ8_0: return {2, {{0, 2, 2}, {2, 32, 4}}};
    case kQ4_0: return {2, {{0, 2, 2}, {2, 16, 4}}};
    case kQ4_1: return {3, {{0, 2, 2}, {2, 2, 2}, {4, 16, 4}}};
    case kQ4_K: return {4, {{0, 2, 2}, {2, 2, 2}, {4, 12, 4}, {16, 128, 4}}};
    case kQ6_K: return {4, {{208, 2, 2}, {192, 16, 4}, {0, 128, 4}, {128, 64, 4}}};
    default: return {0, {}};
  }
}

// Byte offset of field i in a packed block of 16 rows.
constexpr int packed_field_offset(int qt, int i) {
  int off = 0;
  for (int k = 0; k < i; ++k) off += kPackRows * packed_fields(qt).f[k].bytes;
  return off;
}
// Offset of the quant bytes in a packed block of 16 rows (the 32-element types: after the scales).
constexpr int packed_qs_offset(int qt) { return packed_field_offset(qt, packed_fields(qt).count - 1); }

// Row j (< 16) of the packed blocks of one group, back in the file's layout: nb blocks from `group` into dst.
// QT is a template argument so every copy below has a constant size (a load and a store, not a memcpy call).
template <int QT>
inline void unpack_group_row(const uint8_t* group, int64_t nb, int j, uint8_t* dst) {
  constexpr int bb = block_bytes(QT);
  constexpr PackedFields fields = packed_fields(QT);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* src = group + b * kPackRows * bb;
    uint8_t* out = dst + b * bb;
    for (int i = 0; i < fields.count; ++i) {
      const PackedField f = fields.f[i];
      for (int u = 0; u < f.bytes / f.unit; ++u) {
        if (f.unit == 4) {
          std::memcpy(out + f.offset + 4 * u, src + (u * kPackRows + j) * 4, 4);
        } else {
          std::memcpy(out + f.offset + 2 * u, src + (u * kPackRows + j) * 2, 2);
        }
      }
      src += kPackRows * f.bytes;
    }
  }
}

// Row r (< N) of a packed weight, back in the file's layout, into dst[row_bytes].
inline void unpack_row(int qt, const uint8_t* w, int64_t N, int64_t row_bytes, int64_t r, uint8_t* dst) {
  const int64_t full = N / kPackRows * kPackRows;
  if (r >= full) {
    std::memcpy(dst, w + r * row_bytes, static_cast<size_t>(row_bytes));
    return;
  }
  const int j = static_cast<int>(r % kPackRows);
  const uint8_t* group = w + (r - j) * row_bytes;
  const int64_t nb = row_bytes / block_bytes(qt);
  switch (qt) {
    case kQ8_0: return unpack_group_row<kQ8_0>(group, nb, j, dst);
    case kQ4_0: return unpack_group_row<kQ4_0>(group, nb, j, dst);
    case kQ4_1: return unpack_group_row<kQ4_1>(group, nb, j, dst);
    case kQ4_K: return unpack_group_row<kQ4_K>(group, nb, j, dst);
    case kQ6_K: return unpack_group_row<kQ6_K>(group, nb, j, dst);
    default: return;
  }
}

// Rows [n0, n0 + rows) of a packed weight in the file's layout, into dst [rows, row_bytes].
inline void unpack_rows(int qt, const uint8_t* w, int64_t N, int64_t row_bytes, int64_t n0, int64_t rows,
                        uint8_t* dst) {
  for (int64_t i = 0; i < rows; ++i) unpack_row(qt, w, N, row_bytes, n0 + i, dst + i * row_bytes);
}

#ifdef PAGELLM_GGUF_X86
namespace packed {

// x quantized per 32-element block for the packed kernels: [0, 32) int8 qx, [32, 36) fp32 dx, then the
// correction: Q4_1 / Q4_K fp32 dx * sum(qx) (times m / the sub-block's min), Q4_0 int32 -8 * sum(qx), Q8_0 int32
// -128 * sum(qx) (weights + 128); Q6_K int32 -32 * the sum of qx[0:16], then of qx[16:32] (a scale per 16).
template <int QT>
constexpr int64_t x_block_bytes() { return QT == kQ6_K ? 44 : 40; }

template <int QT>
PAGELLM_GGUF_VNNI void quantize_row(const float* x, int64_t nb, uint8_t* dst) {
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* out = dst + b * x_block_bytes<QT>();
    int8_t* q = reinterpret_cast<int8_t*>(out);
    const float dx = vnni::quantize_block(x + b * 32, q);
    int32_t sum[2] = {0, 0};
    for (int i = 0; i < 32; ++i) sum[i / 16] += q[i];
    std::memcpy(out + 32, &dx, 4);
    if constexpr (QT == kQ4_1 || QT == kQ4_K) {
      const float sx = dx * static_cast<float>(sum[0] + sum[1]);
      std::memcpy(out + 36, &sx, 4);
    } else if constexpr (QT == kQ6_K) {
      const int32_t corr[2] = {-32 * sum[0], -32 * sum[1]};
      std::memcpy(out + 36, corr, 8);
    } else {
      const int32_t corr = -(QT == kQ8_0 ? 128 : 8) * (sum[0] + sum[1]);
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
      const uint8_t* xb = x + i * ldx + b * x_block_bytes<QT>();
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

}  // namespace packed
#endif  // PAGELLM_GGUF_X86

}  // namespace pagellm::cpu::gguf
