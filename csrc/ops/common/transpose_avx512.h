// 16 x 16 transposes of 32-bit lanes in AVX-512 registers, shared by the AMX GEMM (x panels, C tiles) and the
// prefill attention kernels (query pairs in, output rows out).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagellm::cpu {

// 16x16 32-bit transpose in registers (r[i] = row i in, column i out): interleave 32-bit then 64-bit
// lanes inside 128-bit groups, then move 128-bit groups across rows twice. 64 shuffles, no tables.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int j = 0; j < 2; ++j) {
      const __m512d a = _mm512_castps_pd(t[i + j]), b = _mm512_castps_pd(t[i + j + 2]);
      r[i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  // r[4g + q] now holds, in each 128-bit group l, elements (4g .. 4g+3, column 4l + q).
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);      // groups 0,2 of each
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);  // groups 1,3 of each
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
}

}  // namespace pagellm::cpu
#endif  // __AVX512F__
