// Quantized KV-cache rows on CPU (docs/kv_cache_layout.md): int8 or fp8-e4m3 values with one fp32 scale per
// (token, kv head) row; the value meant is stored * scale. A row is quantized by its absmax:
//   scale = absmax / kMax,  stored = Q(x * (kMax / absmax))   (all zeros, scale 0, when absmax = 0)
//   int8: Q = round half to even, clamped to [-127, 127];  fp8-e4m3: Q = c10's round-to-nearest-even
//   conversion of the value clamped to [-448, 448].
// Every product is one fp32 multiply, so the pure-torch reference (pagellm.ops.reference) gets the same bits.
// Also the fp32 loads of stored values (vload overloads) the attention kernels dequantize with; they must be
// declared before the kernels' templates, so attention_cpu_common.h includes this header.
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops/common/cpu_vec.h"

namespace pagellm::cpu {

template <typename C>
struct KvQuant;

template <>
struct KvQuant<int8_t> {
  static constexpr float kMax = 127.0f;
  static int8_t from_scaled(float x) { return static_cast<int8_t>(std::clamp(std::nearbyint(x), -127.0f, 127.0f)); }
};

template <>
struct KvQuant<c10::Float8_e4m3fn> {
  static constexpr float kMax = 448.0f;
  static c10::Float8_e4m3fn from_scaled(float x) { return c10::Float8_e4m3fn(std::clamp(x, -448.0f, 448.0f)); }
};

// Whether C is a quantized cache storage type (the cache is then read with per-row scales).
template <typename C>
constexpr bool kIsQuantizedCache = std::is_same_v<C, int8_t> || std::is_same_v<C, c10::Float8_e4m3fn>;

// Quantizes the n values of src into dst; returns the row's scale.
template <typename C, typename T>
inline float quantize_row(const T* src, C* dst, int64_t n) {
  VecF m = vzero();
  for (int64_t i = 0; i < n; i += kLanes) m = vmax(m, vabs(vload(src + i, static_cast<int>(std::min<int64_t>(kLanes, n - i)))));
  const float amax = vmaxall(m);
  const float inv = amax > 0.f ? KvQuant<C>::kMax / amax : 0.f;
  float buf[kLanes];
  for (int64_t i = 0; i < n; i += kLanes) {
    const int c = static_cast<int>(std::min<int64_t>(kLanes, n - i));
    vstore(buf, vmul(vload(src + i, c), vset1(inv)), c);
    for (int e = 0; e < c; ++e) dst[i + e] = KvQuant<C>::from_scaled(buf[e]);
  }
  return amax / KvQuant<C>::kMax;
}

// x[i] *= f[i] for i < n.
inline void mul_elementwise(float* x, const float* f, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const int c = static_cast<int>(std::min<int64_t>(kLanes, n - i));
    vstore(x + i, vmul(vload(x + i, c), vload(f + i, c)), c);
  }
}

#ifdef PAGELLM_AVX512
// (The portable VecF's template vload converts these element types by static_cast.)
inline VecF vload(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline VecF vload(const int8_t* p, int n) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(lane_mask(n), p)))};
}

// 16 fp8-e4m3 bit patterns -> fp32, exact (NaN patterns are never stored). Normals: rebias the exponent
// (7 -> 127) in the integer domain; subnormals (exponent 0): mantissa * 2^-9. No fp32 denormals involved.
inline VecF fp8e4m3_bits_to_f32(__m128i bytes) {
  const __m512i x = _mm512_cvtepu8_epi32(bytes);
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512.0f));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  const __m512 f = _mm512_mask_blend_ps(is_sub, _mm512_castsi512_ps(normal), sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  return {_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign))};
}
inline VecF vload(const c10::Float8_e4m3fn* p) {
  return fp8e4m3_bits_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline VecF vload(const c10::Float8_e4m3fn* p, int n) { return fp8e4m3_bits_to_f32(_mm_maskz_loadu_epi8(lane_mask(n), p)); }
#endif

// load_row_f32 (cpu_vec.h) for stored rows: its template was defined before the loads above existed.
template <typename C>
inline void load_stored_row_f32(const C* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const int c = static_cast<int>(std::min<int64_t>(kLanes, n - i));
    vstore(dst + i, vmul(vload(src + i, c), vset1(scale)), c);
  }
}
inline void load_row_f32(const int8_t* src, float* dst, int64_t n, float scale = 1.0f) {
  load_stored_row_f32(src, dst, n, scale);
}
inline void load_row_f32(const c10::Float8_e4m3fn* src, float* dst, int64_t n, float scale = 1.0f) {
  load_stored_row_f32(src, dst, n, scale);
}

}  // namespace pagellm::cpu
