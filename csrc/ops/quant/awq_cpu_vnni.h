// AVX-512 VNNI tile of awq_linear's small-M path for half-precision (bf16 / fp16) x, the way llama.cpp meets
// 4-bit weights with Q8 activations: x is quantized once per call per (row, 32-block) to int8 (scale
// dx = max|x| / 127, qx = round(x / dx)), and the raw nibbles q (unsigned, 0..15) meet qx (signed) in
// `vpdpbusd`, exactly its u8 x s8 form. For weight row n and group g (blocks b of g, scale s, zero point z):
//   sum_k W[n, k] x[k] ~= s * sum_b dx_b * (dot(q_b, qx_b) - z * sum(qx_b))
//                      = s * sum_b dx_b * dot(q_b, qx_b)  -  s * z * group_sums[g]
// with group_sums[g] = sum_b dx_b * sum(qx_b) precomputed with x, so the zero point costs one FMA per group
// and (row, x row), not per weight. The int8 rounding of x (<= dx / 2 per element, ~0.4% of each block's
// largest |x|) is the only error beyond fp32 summation order; fp32 x never takes this path (the glue keeps
// it on the exact FMA tiles).
//
// Quantized x, per row, per quad Q of blocks (4Q .. 4Q + 3; the last quad zero-padded past K / 32), kQuadBytes
// bytes, in the order 64 weight bytes expand (block i's 16 bytes at 16 i: low nibbles = its elements 0..15,
// high nibbles = 16..31):
//   [0, 64)     qx of the low halves:  x_{4Q+i}[0:16] at 16 i
//   [64, 128)   qx of the high halves: x_{4Q+i}[16:32] at 64 + 16 i
//   [128, 192)  dx of the block each int32 lane of the dot sums (16 floats: lanes 4i .. 4i + 3 = block 4Q + i)
// and per row, K / G floats: group_sums. So a quad of one weight row costs 3 ALU ops to expand (shift, 2 ands)
// and, per x row, 2 vpdpbusd for 128 weights; a tile of 4 weight rows then transposes its 4 dot vectors
// (lane 4b + j: block b of row j) and pays one convert + scale product + FMA per x row for all 4 (NR = 4,
// Rows4Accumulators), other tiles one each per row. The weight rows 16 below are prefetched as they go.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops/quant/awq_cpu_simd.h"

#ifdef PAGELLM_AWQ_X86
#define PAGELLM_AWQ_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")))

namespace pagellm::cpu::awq {
namespace vnni {

constexpr int64_t kQuadBytes = 192;
constexpr int kQuadBlocks = 4;
constexpr int64_t kPrefetchRows = 16;  // software prefetch distance in weight rows (16 KiB at K = 2048)
constexpr int kMaxMR = 4;  // 16 zmm accumulators + a quad's 2 expanded halves, scale, 3 x vectors, the dot

// Rows of x quantized for the tiles (layout above); `from_row` views the rows from row i on.
struct QuantizedX {
  const uint8_t* q;         // row i at q + i * ldq
  int64_t ldq;              // bytes per row: ceil(K / 128) * kQuadBytes
  const float* group_sums;  // row i at group_sums + i * ldg
  int64_t ldg;              // K / G
  QuantizedX from_row(int64_t i) const { return {q + i * ldq, ldq, group_sums + i * ldg, ldg}; }
};

// Lane l of a quad's dot sums block l / 4 (the permutation that spreads 4 per-block values over 16 lanes).
PAGELLM_AWQ_VNNI PAGELLM_AWQ_INLINE __m512i lane_block() {
  return _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
}

// One block of x (32 floats) -> q[0:32] int8, its scale and the sum of q (round to nearest even, as cvtps does).
PAGELLM_AWQ_VNNI PAGELLM_AWQ_INLINE float quantize_block(const float* x, int8_t* q, int* q_sum) {
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float dx = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(dx != 0.f ? 1.f / dx : 0.f);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
  *q_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));  // |x / dx| <= 127: no saturation to differ
  return dx;
}

// x row [nb * 32] fp32 -> ceil(nb / 4) quads at dst and group_sums[nb / bpg] (bpg: blocks per group).
PAGELLM_AWQ_VNNI inline void quantize_row(const float* x, int64_t nb, int64_t bpg, uint8_t* dst, float* group_sums) {
  std::fill(group_sums, group_sums + nb / bpg, 0.f);
  for (int64_t quad = 0; quad < (nb + kQuadBlocks - 1) / kQuadBlocks; ++quad) {
    uint8_t* out = dst + quad * kQuadBytes;
    alignas(16) float dx[kQuadBlocks] = {};
    for (int i = 0; i < kQuadBlocks; ++i) {
      const int64_t b = quad * kQuadBlocks + i;
      alignas(64) int8_t q[kBlockElems] = {};
      if (b < nb) {
        int sum = 0;
        dx[i] = quantize_block(x + b * kBlockElems, q, &sum);
        group_sums[b / bpg] += dx[i] * static_cast<float>(sum);
      }
      std::memcpy(out + 16 * i, q, 16);
      std::memcpy(out + 64 + 16 * i, q + 16, 16);
    }
    _mm512_storeu_ps(out + 128, _mm512_permutexvar_ps(lane_block(), _mm512_castps128_ps512(_mm_load_ps(dx))));
  }
}

// The int32 dot of one quad of x row i with the 64 expanded bytes (lo, hi) of a weight row: lane l sums 4
// products of block l / 4.
PAGELLM_AWQ_VNNI PAGELLM_AWQ_INLINE __m512i quad_dot(__m512i lo, __m512i hi, __m512i xlo, __m512i xhi) {
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo), hi, xhi);
}

// Accumulators of a tile, one vector per (x row i, weight row j), each lane a block's partial sums; used where
// NR != 4. acc[i][j] += dx * s[j] * dot(q[j], qx) per lane for one quad, sv[j]: the scale of each lane's block.
template <int MR, int NR>
struct RowAccumulators {
  __m512 v[MR][NR];

  PAGELLM_AWQ_VNNI PAGELLM_AWQ_INLINE void add_quad(const __m512i (&lo)[NR], const __m512i (&hi)[NR],
                                                    const __m512 (&sv)[NR], const __m512i (&xlo)[MR],
                                                    const __m512i (&xhi)[MR], const __m512 (&dx)[MR]) {
    for (int j = 0; j < NR; ++j)
      for (int i = 0; i < MR; ++i)
        v[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(quad_dot(lo[j], hi[j], xlo[i], xhi[i])), _mm512_mul_ps(dx[i], sv[j]),
                                  v[i][j]);
  }
  PAGELLM_AWQ_VNNI PAGELLM_AWQ_INLINE float sum(int i, int j) const { return _mm512_reduce_add_ps(v[i][j]); }
};

// Four weight rows' dots (lane 4b + l: block b's partial sum l) -> lane 4b + j: block b's whole dot with row j,
// a 4 x 4 transpose-and-add inside each 128-bit lane.
PAGELLM_AWQ_VNNI PAGELLM_AWQ_INLINE __m512i transpose_add4(const __m512i (&d)[4]) {
  const __m512i d01 = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]), _mm512_unpackhi_epi32(d[0], d[1]));
  const __m512i d23 = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2], d[3]), _mm512_unpackhi_epi32(d[2], d[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(d01, d23), _mm512_unpackhi_epi64(d01, d23));
}

// Accumulators of a 4-row tile, one vector per x row i, lane 4b + j: weight row j's sums over blocks b (mod 4).
// The 4 x 4 transpose (integer shuffles and adds) buys one convert, one scale product and one FMA per quad for
// the 4 rows instead of one each per row: the FP ports are what the one-row form saturates.
template <int MR>
struct Rows4Accumulators {
  __m512 v[MR];

  PAGELLM_AWQ_VNNI PAGELLM_AWQ_INLINE void add_quad(const __m512i (&lo)[4], const __m512i (&hi)[4],
                                                    const __m512 (&sv)[4], const __m512i (&xlo)[MR],
                                                    const __m512i (&xhi)[MR], const __m512 (&dx)[MR]) {
    // lane 4b + j: row j's scale of block b (sv[j] holds it in all four lanes of block b)
    const __m512 s = _mm512_mask_blend_ps(0x8888, _mm512_mask_blend_ps(0x4444, _mm512_mask_blend_ps(0x2222, sv[0], sv[1]), sv[2]), sv[3]);
    for (int i = 0; i < MR; ++i) {
      const __m512i d[4] = {quad_dot(lo[0], hi[0], xlo[i], xhi[i]), quad_dot(lo[1], hi[1], xlo[i], xhi[i]),
                            quad_dot(lo[2], hi[2], xlo[i], xhi[i]), quad_dot(lo[3], hi[3], xlo[i], xhi[i])};
      v[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(transpose_add4(d)), _mm512_mul_ps(dx[i], s), v[i]);
    }
  }
  PAGELLM_AWQ_VNNI PAGELLM_AWQ_INLINE float sum(int i, int j) const {
    const __m128 r = _mm_add_ps(_mm_add_ps(_mm512_extractf32x4_ps(v[i], 0), _mm512_extractf32x4_ps(v[i], 1)),
                                _mm_add_ps(_mm512_extractf32x4_ps(v[i], 2), _mm512_extractf32x4_ps(v[i], 3)));
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, r);
    return lanes[j];
  }
};

// The accumulators a (MR, NR) tile uses.
template <int MR, int NR>
using TileAccumulators = std::conditional_t<NR == 4, Rows4Accumulators<MR>, RowAccumulators<MR, NR>>;

// acc += one quad of MR x rows against NR weight rows, each expanded once from its 64 bytes into low and high
// nibbles (bytes[j]); sv[j]: the scale of each lane's block. x's three vectors per row are loaded once per quad.
template <int MR, int NR>
PAGELLM_AWQ_VNNI PAGELLM_AWQ_INLINE void accumulate_quad(const __m512i (&bytes)[NR], const __m512 (&sv)[NR],
                                                         const QuantizedX& x, int64_t quad, TileAccumulators<MR, NR>& acc) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512i xlo[MR], xhi[MR], lo[NR], hi[NR];
  __m512 dx[MR];
  for (int i = 0; i < MR; ++i) {
    const uint8_t* xq = x.q + i * x.ldq + quad * kQuadBytes;
    xlo[i] = _mm512_loadu_si512(xq);
    xhi[i] = _mm512_loadu_si512(xq + 64);
    dx[i] = _mm512_loadu_ps(xq + 128);
  }
  for (int j = 0; j < NR; ++j) {
    lo[j] = _mm512_and_si512(bytes[j], low4);
    hi[j] = _mm512_and_si512(_mm512_srli_epi16(bytes[j], 4), low4);
  }
  acc.add_quad(lo, hi, sv, xlo, xhi, dx);
}

// Software prefetch of the weight rows kPrefetchRows below the NR being read, the line this quad reads of
// each: rows are only K / 2 bytes, too short a stream each for the hardware prefetcher to ramp up on.
template <int NR>
PAGELLM_AWQ_INLINE void prefetch_quad(const AwqWeightView& w, int64_t quad) {
  for (int j = 0; j < NR; ++j) __builtin_prefetch(w.qweight + (j + kPrefetchRows) * w.row_bytes() + quad * 64, 0, 3);
}

// Blocks per group a multiple of 4 (G = 128, 256, ...): a quad lies in one group, its NR scales broadcast.
template <int MR, int NR>
PAGELLM_AWQ_VNNI PAGELLM_AWQ_INLINE void quads_in_one_group(const AwqWeightView& w, const QuantizedX& x,
                                                            TileAccumulators<MR, NR>& acc) {
  const int64_t ldq = w.row_bytes(), ldg = w.num_groups(), quads_per_group = w.blocks_per_group() / kQuadBlocks;
  for (int64_t g = 0; g < ldg; ++g) {
    __m512 sv[NR];
    for (int j = 0; j < NR; ++j) sv[j] = _mm512_set1_ps(w.scales[j * ldg + g]);
    for (int64_t quad = g * quads_per_group; quad < (g + 1) * quads_per_group; ++quad) {
      __m512i bytes[NR];
      for (int j = 0; j < NR; ++j) bytes[j] = _mm512_loadu_si512(w.qweight + j * ldq + quad * 64);
      prefetch_quad<NR>(w, quad);
      accumulate_quad<MR, NR>(bytes, sv, x, quad, acc);
    }
  }
}

// Any other group size (G = 32, 64, 96, ...): each block of a quad takes its own group's scale; a last, partial
// quad reads only its blocks (the padding meets qx = 0, dx = 0).
template <int MR, int NR>
PAGELLM_AWQ_VNNI PAGELLM_AWQ_INLINE void quads_across_groups(const AwqWeightView& w, const QuantizedX& x,
                                                             TileAccumulators<MR, NR>& acc) {
  const int64_t ldq = w.row_bytes(), ldg = w.num_groups(), bpg = w.blocks_per_group(), nb = w.K / kBlockElems;
  int64_t g = 0, g_end = bpg;  // the group of the current block, and the first block past it
  for (int64_t quad = 0; quad < (nb + kQuadBlocks - 1) / kQuadBlocks; ++quad) {
    int64_t groups[kQuadBlocks];
    for (int i = 0; i < kQuadBlocks; ++i) {
      if (quad * kQuadBlocks + i >= g_end && g + 1 < ldg) ++g, g_end += bpg;
      groups[i] = g;
    }
    const int64_t blocks = std::min<int64_t>(kQuadBlocks, nb - quad * kQuadBlocks);
    const __mmask64 mask = blocks == kQuadBlocks ? ~__mmask64(0) : (__mmask64(1) << (16 * blocks)) - 1;
    __m512i bytes[NR];
    __m512 sv[NR];
    for (int j = 0; j < NR; ++j) {
      bytes[j] = _mm512_maskz_loadu_epi8(mask, w.qweight + j * ldq + quad * 64);
      const float* s = w.scales + j * ldg;
      const __m128 s4 = _mm_set_ps(s[groups[3]], s[groups[2]], s[groups[1]], s[groups[0]]);
      sv[j] = _mm512_permutexvar_ps(lane_block(), _mm512_castps128_ps512(s4));
    }
    prefetch_quad<NR>(w, quad);
    accumulate_quad<MR, NR>(bytes, sv, x, quad, acc);
  }
}

// acc[i][j] -= s[j, g] * z[j, g] * group_sums[i, g] summed over g, 16 groups per step.
template <int MR, int NR>
PAGELLM_AWQ_VNNI PAGELLM_AWQ_INLINE void subtract_zero_points(const AwqWeightView& w, const QuantizedX& x,
                                                              __m512 (&acc)[MR][NR]) {
  const int64_t ldg = w.num_groups();
  for (int64_t g = 0; g < ldg; g += 16) {
    const __mmask16 mask = ldg - g >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (ldg - g)) - 1u);
    __m512 sz[NR];
    for (int j = 0; j < NR; ++j) {
      const __m512 s = _mm512_maskz_loadu_ps(mask, w.scales + j * ldg + g);
      const __m512i z = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, w.zeros + j * ldg + g));
      sz[j] = _mm512_mul_ps(s, _mm512_cvtepi32_ps(z));
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 gs = _mm512_maskz_loadu_ps(mask, x.group_sums + i * x.ldg + g);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fnmadd_ps(sz[j], gs, acc[i][j]);
    }
  }
}

// sums[i * lds + j] = quantized x row i . weight row j, i < MR, j < NR.
template <int MR, int NR>
PAGELLM_AWQ_VNNI void tile(const AwqWeightView& w, const QuantizedX& x, float* sums, int64_t lds) {
  TileAccumulators<MR, NR> acc;
  __m512 zero_point_terms[MR][NR];
  for (int i = 0; i < MR; ++i) {
    if constexpr (NR == 4) acc.v[i] = _mm512_setzero_ps();
    for (int j = 0; j < NR; ++j) {
      if constexpr (NR != 4) acc.v[i][j] = _mm512_setzero_ps();
      zero_point_terms[i][j] = _mm512_setzero_ps();
    }
  }
  if (w.blocks_per_group() % kQuadBlocks == 0) {
    quads_in_one_group<MR, NR>(w, x, acc);
  } else {
    quads_across_groups<MR, NR>(w, x, acc);
  }
  subtract_zero_points<MR, NR>(w, x, zero_point_terms);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i * lds + j] = acc.sum(i, j) + _mm512_reduce_add_ps(zero_point_terms[i][j]);
}

}  // namespace vnni

// x rows [M, K] (fp32, row stride ldx) quantized for the VNNI tiles, owning its buffers.
struct VnniX {
  std::vector<uint8_t> q;
  std::vector<float> group_sums;
  vnni::QuantizedX view;
};

inline VnniX quantize_x_vnni(const float* x, int64_t ldx, int64_t M, const AwqWeightView& w) {
  const int64_t nb = w.K / kBlockElems, ldq = (nb + vnni::kQuadBlocks - 1) / vnni::kQuadBlocks * vnni::kQuadBytes, ldg = w.num_groups();
  VnniX out;
  out.q.resize(static_cast<size_t>(M * ldq));
  out.group_sums.resize(static_cast<size_t>(M * ldg));
  for (int64_t m = 0; m < M; ++m)
    vnni::quantize_row(x + m * ldx, nb, w.blocks_per_group(), out.q.data() + m * ldq, out.group_sums.data() + m * ldg);
  out.view = {out.q.data(), ldq, out.group_sums.data(), ldg};
  return out;
}

// The tile functor the generic driver calls (awq_cpu_kernels.h rows_dot); x is a QuantizedX, ldx unused.
template <int MR, int NR>
struct VnniTile {
  static constexpr int kMaxMR = vnni::kMaxMR;
  static void run(const AwqWeightView& w, const vnni::QuantizedX& x, int64_t /*ldx*/, float* sums, int64_t lds) {
    vnni::tile<MR, NR>(w, x, sums, lds);
  }
};

}  // namespace pagellm::cpu::awq
#endif  // PAGELLM_AWQ_X86
