// AVX-512 backend of VecF (included by cpu_vec.h when the compiler targets AVX-512 F/BW/VL/DQ).
#pragma once

#include <immintrin.h>

namespace pagellm::cpu {

struct VecF {
  __m512 v;
};

inline __mmask16 lane_mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }

inline VecF vzero() { return {_mm512_setzero_ps()}; }
inline VecF vset1(float x) { return {_mm512_set1_ps(x)}; }
inline VecF vadd(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VecF vsub(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VecF vmul(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VecF vdiv(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VecF vmax(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
inline VecF vmin(VecF a, VecF b) { return {_mm512_min_ps(a.v, b.v)}; }
inline VecF vfma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a*b+c
inline VecF vabs(VecF a) { return {_mm512_abs_ps(a.v)}; }
// Horizontal reductions as one explicit tree (GCC's _mm512_reduce_add_ps order, written out so that every
// compiler and the AVX2 backend add in the same order): halves, then quarters, then lanes (0+2, 1+3), then 0+1.
inline __m128 reduce_tree_128(__m512 a, bool use_max) {
  const __m256 lo = _mm512_castps512_ps256(a), hi = _mm512_extractf32x8_ps(a, 1);
  const __m256 h = use_max ? _mm256_max_ps(hi, lo) : _mm256_add_ps(hi, lo);
  const __m128 q0 = _mm256_castps256_ps128(h), q1 = _mm256_extractf128_ps(h, 1);
  const __m128 q = use_max ? _mm_max_ps(q1, q0) : _mm_add_ps(q1, q0);
  const __m128 s = _mm_shuffle_ps(q, q, 0x4E);  // lanes (2, 3, 0, 1)
  return use_max ? _mm_max_ps(q, s) : _mm_add_ps(q, s);
}
inline float vsum(VecF a) {
  const __m128 t = reduce_tree_128(a.v, false);
  return _mm_cvtss_f32(t) + _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1));
}
inline float vmaxall(VecF a) {
  const __m128 t = reduce_tree_128(a.v, true);
  return std::max(_mm_cvtss_f32(t), _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1)));
}
// Lane i of the result = sum of the lanes of v[i], for 16 vectors: a transpose-style add tree
// (45 shuffle/add ops) instead of 16 horizontal reductions.
inline VecF vsum16(const VecF* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // u[i]: 128-bit lane L holds the lane-L partial sums of v[4i..4i+3].
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD))};
}
// Lanes (2i, 2i+1) swapped: GPT-J rotary pairs.
inline VecF vswap_pairs(VecF a) { return {_mm512_permute_ps(a.v, 0xB1)}; }
// Copy the sign of `s` onto |a|.
inline VecF vcopysign(VecF a, VecF s) {
  const __m512i sign = _mm512_set1_epi32(0x80000000);
  __m512i r = _mm512_or_si512(_mm512_andnot_si512(sign, _mm512_castps_si512(a.v)),
                              _mm512_and_si512(sign, _mm512_castps_si512(s.v)));
  return {_mm512_castsi512_ps(r)};
}
// Lane i = (i < n) ? a : b, for masking keys.
inline VecF vselect_lt(VecF lhs, VecF rhs, VecF a, VecF b) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(lhs.v, rhs.v, _CMP_LT_OQ), b.v, a.v)};
}

inline VecF vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline VecF vload(const float* p, int n) { return {_mm512_maskz_loadu_ps(lane_mask(n), p)}; }
inline VecF bf16_bits_to_f32(__m256i h) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline VecF vload(const c10::BFloat16* p) { return bf16_bits_to_f32(_mm256_loadu_si256((const __m256i*)p)); }
inline VecF vload(const c10::BFloat16* p, int n) {
  return bf16_bits_to_f32(_mm256_maskz_loadu_epi16(lane_mask(n), p));
}
inline VecF vload(const c10::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
inline VecF vload(const c10::Half* p, int n) { return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lane_mask(n), p))}; }

inline __m256i f32_to_bf16_bits(VecF a) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(a.v);
#else
  __m512i b = _mm512_castps_si512(a.v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
#endif
}
inline void vstore(float* p, VecF a) { _mm512_storeu_ps(p, a.v); }
inline void vstore(float* p, VecF a, int n) { _mm512_mask_storeu_ps(p, lane_mask(n), a.v); }
inline void vstore(c10::BFloat16* p, VecF a) { _mm256_storeu_si256((__m256i*)p, f32_to_bf16_bits(a)); }
inline void vstore(c10::BFloat16* p, VecF a, int n) { _mm256_mask_storeu_epi16(p, lane_mask(n), f32_to_bf16_bits(a)); }
inline __m256i f32_to_f16_bits(VecF a) { return _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void vstore(c10::Half* p, VecF a) { _mm256_storeu_si256((__m256i*)p, f32_to_f16_bits(a)); }
inline void vstore(c10::Half* p, VecF a, int n) { _mm256_mask_storeu_epi16(p, lane_mask(n), f32_to_f16_bits(a)); }

// Round-trips through T's precision (HF-style intermediate casts).
inline VecF vround(VecF a, float*) { return a; }
inline VecF vround(VecF a, c10::BFloat16*) { return bf16_bits_to_f32(f32_to_bf16_bits(a)); }
inline VecF vround(VecF a, c10::Half*) { return {_mm512_cvtph_ps(f32_to_f16_bits(a))}; }

// exp(x), relative error ~2 ulp on [-87, 88]; exactly 0 below -87 (so masked -inf scores vanish).
inline VecF vexp(VecF x) {
  __m512 xc = _mm512_min_ps(_mm512_max_ps(x.v, _mm512_set1_ps(-87.5f)), _mm512_set1_ps(88.5f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512 res = _mm512_scalef_ps(p, n);
  return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), res)};
}

// exp(x) for values that are rounded to bf16 afterwards (attention probabilities): one-constant ln2 and a
// degree-5 Taylor polynomial on |r| <= ln2/2, relative error < 3e-6 (bf16 keeps 2^-9), 12 instructions
// against vexp's 16. Exactly 0 below -87, as vexp.
inline VecF vexp_lowp(VecF x) {
  const __m512 xc = _mm512_max_ps(x.v, _mm512_set1_ps(-87.5f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945309f), xc);
  __m512 p = _mm512_set1_ps(1.0f / 120.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), _mm512_scalef_ps(p, n))};
}

#ifdef __AVX512BF16__
#define PAGELLM_BF16_DOT 1
// 32 bf16 values as 16 (even, odd) pairs, the operand of vdot_bf16.
struct BF16x32 {
  __m512bh v;
};
inline BF16x32 bf16x32_load(const c10::BFloat16* p) { return {(__m512bh)_mm512_loadu_si512(p)}; }
// Only the first `left` values (left < 32: the rest read as 0).
inline BF16x32 bf16x32_load(const c10::BFloat16* p, int64_t left) {
  if (left >= 32) return bf16x32_load(p);
  return {(__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << left) - 1), p)};
}
// Every pair = (bits & 0xffff, bits >> 16): one bf16 pair broadcast to all 16 lanes (even value in the low half).
inline BF16x32 bf16x32_set1_pair(uint32_t bits) { return {(__m512bh)_mm512_set1_epi32(static_cast<int>(bits))}; }
// Lane i: acc + a[2i+1] * b[2i+1] + a[2i] * b[2i] (vdpbf16ps: the odd product first, one rounding per add).
inline VecF vdot_bf16(VecF acc, BF16x32 a, BF16x32 b) { return {_mm512_dpbf16_ps(acc.v, a.v, b.v)}; }
// Element-wise pairs of two 32-value rows: lo = (a[k], b[k]) for k = 0..15 in order, hi = the same for k = 16..31
// (the vdot_bf16 operand of two keys' value rows: lane k then sums both keys' products for dimension k). The
// qword permute puts dims 4L..4L+3 and 16+4L.. in 128-bit lane L, where the in-lane word unpacks meet them.
inline void bf16x32_zip(BF16x32 a, BF16x32 b, BF16x32& lo, BF16x32& hi) {
  const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
  const __m512i pa = _mm512_permutexvar_epi64(order, (__m512i)a.v), pb = _mm512_permutexvar_epi64(order, (__m512i)b.v);
  lo = {(__m512bh)_mm512_unpacklo_epi16(pa, pb)};
  hi = {(__m512bh)_mm512_unpackhi_epi16(pa, pb)};
}
// 16 pairs to dst (dword i = bf16(even[i]) | bf16(odd[i]) << 16, rounded to nearest even): what
// bf16x32_load reads back as the operand of vdot_bf16.
inline void vstore_bf16_pairs(uint32_t* dst, VecF even, VecF odd) {
  const __m512i e = _mm512_cvtepu16_epi32(f32_to_bf16_bits(even)), o = _mm512_cvtepu16_epi32(f32_to_bf16_bits(odd));
  _mm512_storeu_si512(dst, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
}
#endif

}  // namespace pagellm::cpu
