// int8 x int8 -> int32 dot products of a block of activation rows against a block of weight rows, one
// implementation per instruction set (AVX-512 VNNI, AVX2, plain C++). Each is compiled for its own ISA
// with a function target attribute, whatever -march the file is built with, so the caller can pick one at
// run time from CPUID (int8_linear_cpu.cpp) and never executes an instruction the CPU lacks.
//
// Shared contract of dot_block_<isa><ZP>(w, ldw, q, ldq, row_term, K, mr, nr, acc, prefetch):
//   w        [nr, K] int8 weight rows (row stride ldw; any value in [-128, 127]);
//   q        [mr, ldq] quantized activations, ldq a multiple of 64, zero beyond K: int8 values (ZP false) or
//            uint8 codes (ZP true, the same bytes read as unsigned);
//   row_term [mr] ZP false: the row sums of q (the VNNI path's unsigned-offset correction); ZP true: the rows'
//            zero points z_i in [0, 255];
//   acc      [mr, kInt8NR] (row stride kInt8NR): acc[i][j] = sum_k (q[i][k] - z_i) * w[j][k] (z_i = 0 for
//            int8 rows), exact in int32 (|acc| <= 128 * 127 * K for int8 rows, K < 2^17; <= 128 * 255 * K
//            for uint8 rows, K < 2^16);
//   prefetch true: the VNNI tiles prefetch the weight rows below the block (the caller's first pass over
//            them; later passes find them in cache, where prefetching the next rows would only evict them).
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PAGELLM_INT8_X86 1
#define PAGELLM_TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define PAGELLM_TARGET_AVX2 __attribute__((target("avx2")))
#endif

namespace pagellm::cpu::int8 {

constexpr int kInt8MR = 4;  // activation rows per block (register tile rows)
constexpr int kInt8NR = 4;  // weight rows per block (register tile columns)
// Weight rows ahead of a VNNI tile's that it prefetches, one cache line per row per 64-byte step: four rows
// read side by side are too many streams for the hardware prefetcher to keep memory busy (a 4-row group tile
// at M = 1 took ~1.3x the time without it); a one-row tile streams ahead of the rows it reads next.
constexpr int64_t kInt8PrefetchRows = 4;

// ---------------------------------------------------------------- plain C++ (any CPU)
// Activation value k of row `qi` minus the row's zero point z (an int8 value, or a uint8 code under ZP).
template <bool ZP>
inline int32_t centered(const int8_t* qi, int64_t k, int32_t z) {
  if constexpr (ZP) return static_cast<int32_t>(reinterpret_cast<const uint8_t*>(qi)[k]) - z;
  return static_cast<int32_t>(qi[k]);
}

template <bool ZP>
inline void dot_block_scalar(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq, const int32_t* row_term,
                             int64_t K, int mr, int nr, int32_t* acc, bool /*prefetch*/) {
  for (int i = 0; i < mr; ++i) {
    const int32_t z = ZP ? row_term[i] : 0;
    for (int j = 0; j < nr; ++j) {
      const int8_t* qi = q + i * ldq;
      const int8_t* wj = w + j * ldw;
      int32_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += centered<ZP>(qi, k, z) * static_cast<int32_t>(wj[k]);
      acc[i * kInt8NR + j] = s;
    }
  }
}

#ifdef PAGELLM_INT8_X86
// ---------------------------------------------------------------- AVX-512 VNNI
// vpdpbusd multiplies unsigned bytes by signed bytes. int8 rows: the weight is signed, so it is offset into
// the unsigned operand: (w ^ 0x80) = w + 128 as u8, and sum (w + 128) * q = sum w * q + 128 * sum q; the
// second term is removed with the precomputed row sum of q. uint8 rows (ZP): the codes are the unsigned
// operand as they are, and sum (q - z) * w = sum q * w - z * sum w, with the weight row sums taken by one
// more vpdpbusd against ones per weight vector (shared by the tile's activation rows). Int32 wrap-around
// cannot change the exact result (every step is an addition modulo 2^32 and the true value fits).
// The lane sums of four vectors, [sum a0, sum a1, sum a2, sum a3], in 11 instructions (an add tree over
// interleaved lanes) instead of four horizontal reductions.
PAGELLM_TARGET_VNNI inline __m128i reduce4_epi32(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  // per 128-bit lane: [a0 (0+2), a1 (0+2), a0 (1+3), a1 (1+3)] and the same for a2, a3
  const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
  const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
  // per 128-bit lane: [a0, a1, a2, a3] partial sums
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// One 64-byte step of a VNNI tile: NR weight vectors against MR activation vectors (ZP: plus the weight sums).
template <int MR, int NR, bool ZP>
PAGELLM_TARGET_VNNI __attribute__((always_inline)) inline void dot_step_vnni(const __m512i* w_raw, const int8_t* q,
                                                                              int64_t ldq, __m512i (&acc)[MR][NR],
                                                                              __m512i (&wsum)[NR]) {
  __m512i wv[NR];
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) {
    if constexpr (ZP) {
      wv[j] = w_raw[j];
      wsum[j] = _mm512_dpbusd_epi32(wsum[j], _mm512_set1_epi8(1), w_raw[j]);
    } else {
      wv[j] = _mm512_xor_si512(w_raw[j], _mm512_set1_epi8(static_cast<char>(0x80)));
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    const __m512i xv = _mm512_loadu_si512(q + i * ldq);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j)
      acc[i][j] = ZP ? _mm512_dpbusd_epi32(acc[i][j], xv, wv[j]) : _mm512_dpbusd_epi32(acc[i][j], wv[j], xv);
  }
}

template <int MR, int NR, bool ZP>
PAGELLM_TARGET_VNNI void dot_tile_vnni(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq,
                                       const int32_t* row_term, int64_t K, int32_t* acc_out, bool prefetch) {
  __m512i acc[MR][NR], wsum[NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) wsum[j] = _mm512_setzero_si512();
  int64_t k = 0;
  __m512i w_raw[NR];
  for (; k + 64 <= K; k += 64) {
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      if (prefetch) __builtin_prefetch(w + (j + kInt8PrefetchRows) * ldw + k, 0, 3);
      w_raw[j] = _mm512_loadu_si512(w + j * ldw + k);
    }
    dot_step_vnni<MR, NR, ZP>(w_raw, q + k, ldq, acc, wsum);
  }
  if (k < K) {  // masked weight load (never past the row); q is zero-padded, so the offset lanes add 0
    const __mmask64 mask = (~0ULL) >> (64 - (K - k));
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) w_raw[j] = _mm512_maskz_loadu_epi8(mask, w + j * ldw + k);
    dot_step_vnni<MR, NR, ZP>(w_raw, q + k, ldq, acc, wsum);
  }
  // the correction: int8 rows 128 * sum q (per activation row), uint8 rows z_i * sum w (per pair); the four
  // weight sums of a full tile reduced together, once for all its activation rows
  uint32_t wsums[NR] = {};
  __m128i wsums4 = _mm_setzero_si128();
  if constexpr (ZP && NR == 4) {
    wsums4 = reduce4_epi32(wsum[0], wsum[1], wsum[2], wsum[3]);
  } else if constexpr (ZP) {
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) wsums[j] = static_cast<uint32_t>(_mm512_reduce_add_epi32(wsum[j]));
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    const uint32_t r = static_cast<uint32_t>(row_term[i]);
    if constexpr (NR == 4) {
      const __m128i offset = ZP ? _mm_mullo_epi32(_mm_set1_epi32(static_cast<int32_t>(r)), wsums4)
                                : _mm_set1_epi32(static_cast<int32_t>(128u * r));
      const __m128i sums = reduce4_epi32(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(acc_out + i * kInt8NR), _mm_sub_epi32(sums, offset));
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const uint32_t biased = static_cast<uint32_t>(_mm512_reduce_add_epi32(acc[i][j]));
        acc_out[i * kInt8NR + j] = static_cast<int32_t>(biased - (ZP ? r * wsums[j] : 128u * r));
      }
    }
  }
}

// ---------------------------------------------------------------- AVX2
// Sign-extend 16 bytes of each operand to int16 and vpmaddwd pairs into int32 lanes: exact for every
// int8 value (vpmaddubsw would saturate at 255 * 127 * 2). uint8 codes (ZP) are zero-extended and centered,
// q - z in [-255, 255]: a pair sums to at most 2 * 255 * 128, still exact.
template <int MR, int NR, bool ZP>
PAGELLM_TARGET_AVX2 void dot_tile_avx2(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq,
                                       const int32_t* row_term, int64_t K, int32_t* acc_out) {
  __m256i acc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m256i wv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j)
      wv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * ldw + k)));
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * ldq + k));
      const __m256i xv =
          ZP ? _mm256_sub_epi16(_mm256_cvtepu8_epi16(raw), _mm256_set1_epi16(static_cast<int16_t>(row_term[i])))
             : _mm256_cvtepi8_epi16(raw);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(wv[j], xv));
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc[i][j]), _mm256_extracti128_si256(acc[i][j], 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      const __m128i s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1));
      int32_t s = _mm_cvtsi128_si32(s1);
      const int32_t z = ZP ? row_term[i] : 0;
      for (int64_t t = k; t < K; ++t) s += centered<ZP>(q + i * ldq, t, z) * static_cast<int32_t>(w[j * ldw + t]);
      acc_out[i * kInt8NR + j] = s;
    }
}

// Runtime (mr, nr) -> the register tile instantiated for it: NR = kInt8NR or 1 (weight-row tails).
template <int NR, bool ZP>
inline void dot_rows_vnni(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq, const int32_t* row_term,
                          int64_t K, int mr, int32_t* acc, bool prefetch) {
  switch (mr) {
    case 1: dot_tile_vnni<1, NR, ZP>(w, ldw, q, ldq, row_term, K, acc, prefetch); break;
    case 2: dot_tile_vnni<2, NR, ZP>(w, ldw, q, ldq, row_term, K, acc, prefetch); break;
    case 3: dot_tile_vnni<3, NR, ZP>(w, ldw, q, ldq, row_term, K, acc, prefetch); break;
    default: dot_tile_vnni<4, NR, ZP>(w, ldw, q, ldq, row_term, K, acc, prefetch); break;
  }
}

template <int NR, bool ZP>
inline void dot_rows_avx2(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq, const int32_t* row_term,
                          int64_t K, int mr, int32_t* acc) {
  switch (mr) {
    case 1: dot_tile_avx2<1, NR, ZP>(w, ldw, q, ldq, row_term, K, acc); break;
    case 2: dot_tile_avx2<2, NR, ZP>(w, ldw, q, ldq, row_term, K, acc); break;
    case 3: dot_tile_avx2<3, NR, ZP>(w, ldw, q, ldq, row_term, K, acc); break;
    default: dot_tile_avx2<4, NR, ZP>(w, ldw, q, ldq, row_term, K, acc); break;
  }
}

template <bool ZP>
inline void dot_block_vnni(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq, const int32_t* row_term,
                           int64_t K, int mr, int nr, int32_t* acc, bool prefetch) {
  // One x row: weight rows one after another (as group_block_vnni)
  if (nr == kInt8NR && mr > 1) return dot_rows_vnni<kInt8NR, ZP>(w, ldw, q, ldq, row_term, K, mr, acc, prefetch);
  for (int j = 0; j < nr; ++j) dot_rows_vnni<1, ZP>(w + j * ldw, ldw, q, ldq, row_term, K, mr, acc + j, prefetch);
}

template <bool ZP>
inline void dot_block_avx2(const int8_t* w, int64_t ldw, const int8_t* q, int64_t ldq, const int32_t* row_term,
                           int64_t K, int mr, int nr, int32_t* acc, bool /*prefetch*/) {
  if (nr == kInt8NR) return dot_rows_avx2<kInt8NR, ZP>(w, ldw, q, ldq, row_term, K, mr, acc);
  for (int j = 0; j < nr; ++j) dot_rows_avx2<1, ZP>(w + j * ldw, ldw, q, ldq, row_term, K, mr, acc + j);
}
#endif  // PAGELLM_INT8_X86

}  // namespace pagellm::cpu::int8
