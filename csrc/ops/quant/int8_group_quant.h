// The group scheme's activation pass on AVX-512 (int8_linear's default: absmax int8 per group of group_size
// elements of K), for the common case of a batch with no outlier column: one pass over each group of x
// (its absmax, then its codes from the same L1 lines), the codes, scales and VNNI lane corrections written
// together. The arithmetic is int8_cpu_kernels.h's scalar rule, operation for operation (an IEEE multiply by
// inv = 127 / absmax, round half to even, clamp to [-127, 127]; absmax 0 gives inv 0), so both paths give the
// same bytes. A group over the threshold stops it: the caller then runs the general path (outlier columns).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops/quant/int8_group_tiles.h"

namespace pagellm::cpu::int8 {

#ifdef PAGELLM_INT8_X86
// x[0 .. n) as fp32 lanes (n <= 16; lanes past n are 0).
template <typename T>
PAGELLM_TARGET_VNNI __attribute__((always_inline)) inline __m512 load16_f32(const T* x, int n) {
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1u);
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, x);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, x);
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else
      return _mm512_cvtph_ps(h);
  }
}

// max |x[k]| over [k0, k1) (NaN lanes ignored, as the scalar std::max chain does).
template <typename T>
PAGELLM_TARGET_VNNI inline float group_absmax_vnni(const T* x, int64_t k0, int64_t k1) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k += 16)
    amax = _mm512_max_ps(_mm512_abs_ps(load16_f32(x + k, static_cast<int>(std::min<int64_t>(16, k1 - k)))), amax);
  return _mm512_reduce_max_ps(amax);
}

// The codes of x[k0, k1) with multiplier inv into q[k0, ..) in whole 64-byte steps (zero past k1), and the
// group's lane corrections into corr[16].
template <typename T>
PAGELLM_TARGET_VNNI inline void quantize_group_vnni(const T* x, int64_t k0, int64_t k1, float inv, int8_t* q,
                                                    int32_t* corr) {
  const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  __m512i lane_sum = _mm512_setzero_si512();
  for (int64_t k = k0; k < k1; k += 64) {
    __m128i bytes[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const int64_t left = k1 - (k + 16 * c);
      __m512 v = left > 0 ? load16_f32(x + k + 16 * c, static_cast<int>(std::min<int64_t>(16, left)))
                          : _mm512_setzero_ps();
      v = _mm512_roundscale_ps(_mm512_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);  // max(v, lo): a NaN becomes -127, as std::max(-127.f, v)
      bytes[c] = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v));
    }
    __m512i qv = _mm512_castsi128_si512(bytes[0]);
    qv = _mm512_inserti32x4(qv, bytes[1], 1);
    qv = _mm512_inserti32x4(qv, bytes[2], 2);
    qv = _mm512_inserti32x4(qv, bytes[3], 3);
    _mm512_storeu_si512(q + k, qv);
    lane_sum = _mm512_dpbusd_epi32(lane_sum, _mm512_set1_epi8(1), qv);
  }
  _mm512_storeu_si512(corr, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(lane_sum, 7)));
}

// One row x [K] into q [ldq >= K rounded up to 64], scale [G], corr [G, 16]. Returns false as soon as a
// group's absmax is over threshold (> 0), leaving them partly written.
template <typename T>
PAGELLM_TARGET_VNNI bool quantize_group_row_vnni(const T* x, int64_t K, int64_t gs, float threshold, int8_t* q,
                                                 float* scale, int32_t* corr) {
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += gs, ++g) {
    const int64_t k1 = std::min(K, k0 + gs);
    const float absmax = group_absmax_vnni(x, k0, k1);
    if (threshold > 0.f && absmax > threshold) return false;
    quantize_group_vnni(x, k0, k1, absmax > 0.f ? 127.f / absmax : 0.f, q, corr + g * kGroupLanes);
    scale[g] = absmax / 127.f;
  }
  return true;
}
#endif  // PAGELLM_INT8_X86

}  // namespace pagellm::cpu::int8
