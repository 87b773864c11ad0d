// AVX2 + FMA + F16C backend of VecF (included by cpu_vec.h for x86-64-v3 targets without AVX-512): 16 lanes
// as two __m256 (lo = lanes 0-7, hi = lanes 8-15). Every function performs the AVX-512 backend's operations
// in its order, so lane-wise results, the reduction trees (vsum, vmaxall, vsum16), vexp / vexp_lowp and the
// bf16 pair dot (vdot_bf16 = vdpbf16ps) are bit-identical to it on normal numbers. Known differences:
// vdot_bf16 does not flush denormal inputs / outputs to zero as vdpbf16ps does, and f32 -> bf16 is the
// software rounding (NaN -> 0x7fc0, denormals rounded) that the AVX-512 backend uses without AVX512-BF16.
#pragma once

#include <immintrin.h>

#include <cstring>

namespace pagellm::cpu {

struct VecF {
  __m256 lo, hi;
};

namespace avx2_detail {
// All-ones in the 32-bit lanes [first, first + 8) that are < n.
inline __m256i lane_mask8(int n, int first) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n - first), idx);
}
// p * 2^n for integer-valued n in [-252, 254] with one rounding, as _mm512_scalef_ps: two exact power-of-two
// factors (2^n alone is not a normal float at both ends of vexp's range).
inline __m256 scalef(__m256 p, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(_mm256_min_ps(n, _mm256_set1_ps(254.0f)));
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
// 16 bf16 bit patterns (one __m128i per 8 lanes) -> fp32: exact.
inline __m256 bf16x8_to_f32(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
// 8 fp32 -> bf16 bits in the low 16 bits of each 32-bit lane (round to nearest even, NaN -> 0x7fc0).
inline __m256i f32_to_bf16x8(__m256 a) {
  const __m256i b = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}
// Two vectors of 8 values in 16-bit lanes -> 16 packed uint16 in lane order.
inline __m256i pack_u16(__m256i lo, __m256i hi) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
}
}  // namespace avx2_detail

inline VecF vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VecF vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
#define PAGELLM_AVX2_BINOP(name, intrin) \
  inline VecF name(VecF a, VecF b) { return {intrin(a.lo, b.lo), intrin(a.hi, b.hi)}; }
PAGELLM_AVX2_BINOP(vadd, _mm256_add_ps)
PAGELLM_AVX2_BINOP(vsub, _mm256_sub_ps)
PAGELLM_AVX2_BINOP(vmul, _mm256_mul_ps)
PAGELLM_AVX2_BINOP(vdiv, _mm256_div_ps)
PAGELLM_AVX2_BINOP(vmax, _mm256_max_ps)
PAGELLM_AVX2_BINOP(vmin, _mm256_min_ps)
#undef PAGELLM_AVX2_BINOP
inline VecF vfma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline VecF vabs(VecF a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
// The AVX-512 backend's tree: hi half + lo half, then quarters, then lanes (0+2, 1+3), then 0+1.
inline __m128 reduce_tree_128(VecF a, bool use_max) {
  const __m256 h = use_max ? _mm256_max_ps(a.hi, a.lo) : _mm256_add_ps(a.hi, a.lo);
  const __m128 q0 = _mm256_castps256_ps128(h), q1 = _mm256_extractf128_ps(h, 1);
  const __m128 q = use_max ? _mm_max_ps(q1, q0) : _mm_add_ps(q1, q0);
  const __m128 s = _mm_shuffle_ps(q, q, 0x4E);
  return use_max ? _mm_max_ps(q, s) : _mm_add_ps(q, s);
}
inline float vsum(VecF a) {
  const __m128 t = reduce_tree_128(a, false);
  return _mm_cvtss_f32(t) + _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1));
}
inline float vmaxall(VecF a) {
  const __m128 t = reduce_tree_128(a, true);
  return std::max(_mm_cvtss_f32(t), _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1)));
}
// Lane i of the result = sum of the lanes of v[i]: the AVX-512 vsum16's tree (per 128-bit group (0+2) + (1+3),
// then groups (0+1) + (2+3)); the first two steps stay inside 128-bit lanes, so they run on each half as is.
inline VecF vsum16(const VecF* v) {
  __m256 t[2][8], u[2][4];
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 8; ++i) {
      const __m256 a = h ? v[2 * i].hi : v[2 * i].lo, b = h ? v[2 * i + 1].hi : v[2 * i + 1].lo;
      t[h][i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    }
    for (int i = 0; i < 4; ++i) {
      const __m256d a = _mm256_castps_pd(t[h][2 * i]), b = _mm256_castps_pd(t[h][2 * i + 1]);
      u[h][i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
  }
  // u[0][i] holds groups 0, 1 and u[1][i] groups 2, 3 of vectors 4i..4i+3: s_i = (g0 + g1) + (g2 + g3).
  __m128 s[4];
  for (int i = 0; i < 4; ++i) {
    const __m128 g01 = _mm_add_ps(_mm256_castps256_ps128(u[0][i]), _mm256_extractf128_ps(u[0][i], 1));
    const __m128 g23 = _mm_add_ps(_mm256_castps256_ps128(u[1][i]), _mm256_extractf128_ps(u[1][i], 1));
    s[i] = _mm_add_ps(g01, g23);
  }
  return {_mm256_set_m128(s[1], s[0]), _mm256_set_m128(s[3], s[2])};
}
// Lanes (2i, 2i+1) swapped: GPT-J rotary pairs.
inline VecF vswap_pairs(VecF a) { return {_mm256_permute_ps(a.lo, 0xB1), _mm256_permute_ps(a.hi, 0xB1)}; }
// Copy the sign of `s` onto |a|.
inline VecF vcopysign(VecF a, VecF s) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x80000000));
  return {_mm256_or_ps(_mm256_andnot_ps(sign, a.lo), _mm256_and_ps(sign, s.lo)),
          _mm256_or_ps(_mm256_andnot_ps(sign, a.hi), _mm256_and_ps(sign, s.hi))};
}
// Lane i = (lhs < rhs) ? a : b.
inline VecF vselect_lt(VecF lhs, VecF rhs, VecF a, VecF b) {
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(lhs.lo, rhs.lo, _CMP_LT_OQ)),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(lhs.hi, rhs.hi, _CMP_LT_OQ))};
}

inline VecF vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline VecF vload(const float* p, int n) {
  return {_mm256_maskload_ps(p, avx2_detail::lane_mask8(n, 0)), _mm256_maskload_ps(p + 8, avx2_detail::lane_mask8(n, 8))};
}
inline VecF vload(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {avx2_detail::bf16x8_to_f32(_mm256_castsi256_si128(h)), avx2_detail::bf16x8_to_f32(_mm256_extracti128_si256(h, 1))};
}
inline VecF vload(const c10::Half* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
// 16-bit types with n < 16 lanes (no 16-bit masked load in AVX2): through a zeroed stack buffer.
template <typename T>
inline VecF vload_via_buffer(const T* p, int n) {
  alignas(32) T buf[kLanes];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, sizeof(T) * n);
  return vload(static_cast<const T*>(buf));
}
inline VecF vload(const c10::BFloat16* p, int n) { return vload_via_buffer(p, n); }
inline VecF vload(const c10::Half* p, int n) { return vload_via_buffer(p, n); }
// Other element types (int8, fp8 of the quantized KV cache): exact conversion lane by lane.
template <typename T>
inline VecF vload(const T* p, int n = kLanes) {
  alignas(32) float buf[kLanes];
  for (int i = 0; i < kLanes; ++i) buf[i] = i < n ? static_cast<float>(p[i]) : 0.f;
  return vload(static_cast<const float*>(buf));
}

inline __m256i f32_to_bf16_bits(VecF a) {
  return avx2_detail::pack_u16(avx2_detail::f32_to_bf16x8(a.lo), avx2_detail::f32_to_bf16x8(a.hi));
}
inline __m256i f32_to_f16_bits(VecF a) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return _mm256_set_m128i(_mm256_cvtps_ph(a.hi, kRound), _mm256_cvtps_ph(a.lo, kRound));
}
inline void vstore(float* p, VecF a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline void vstore(float* p, VecF a, int n) {
  _mm256_maskstore_ps(p, avx2_detail::lane_mask8(n, 0), a.lo);
  _mm256_maskstore_ps(p + 8, avx2_detail::lane_mask8(n, 8), a.hi);
}
inline void vstore(c10::BFloat16* p, VecF a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f32_to_bf16_bits(a)); }
inline void vstore(c10::Half* p, VecF a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f32_to_f16_bits(a)); }
inline void store_bits_n(void* p, __m256i bits, int n) {
  alignas(32) uint16_t buf[kLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), bits);
  std::memcpy(p, buf, sizeof(uint16_t) * n);
}
inline void vstore(c10::BFloat16* p, VecF a, int n) { store_bits_n(p, f32_to_bf16_bits(a), n); }
inline void vstore(c10::Half* p, VecF a, int n) { store_bits_n(p, f32_to_f16_bits(a), n); }

// Round-trips through T's precision (HF-style intermediate casts).
inline VecF vround(VecF a, float*) { return a; }
inline VecF vround(VecF a, c10::BFloat16*) {
  const __m256i b = f32_to_bf16_bits(a);
  return {avx2_detail::bf16x8_to_f32(_mm256_castsi256_si128(b)), avx2_detail::bf16x8_to_f32(_mm256_extracti128_si256(b, 1))};
}
inline VecF vround(VecF a, c10::Half*) {
  const __m256i h = f32_to_f16_bits(a);
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}

namespace avx2_detail {
constexpr int kRoundNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
inline __m256 vexp8(__m256 x) {
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.5f)), _mm256_set1_ps(88.5f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)), kRoundNearest);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  return _mm256_and_ps(scalef(p, n), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}
inline __m256 vexp_lowp8(__m256 x) {
  const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(-87.5f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)), kRoundNearest);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147180559945309f), xc);
  __m256 p = _mm256_set1_ps(1.0f / 120.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  return _mm256_and_ps(scalef(p, n), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}
}  // namespace avx2_detail

// exp(x): the AVX-512 backend's polynomial and range handling (exactly 0 below -87).
inline VecF vexp(VecF x) { return {avx2_detail::vexp8(x.lo), avx2_detail::vexp8(x.hi)}; }
// exp(x) for values rounded to bf16 afterwards: the AVX-512 backend's vexp_lowp.
inline VecF vexp_lowp(VecF x) { return {avx2_detail::vexp_lowp8(x.lo), avx2_detail::vexp_lowp8(x.hi)}; }

#define PAGELLM_BF16_DOT 1
// 32 bf16 values as 16 (even, odd) pairs, the operand of vdot_bf16 (lo: values 0-15, hi: 16-31).
struct BF16x32 {
  __m256i lo, hi;
};
inline BF16x32 bf16x32_load(const c10::BFloat16* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
}
// Only the first `left` values (left < 32: the rest read as 0).
inline BF16x32 bf16x32_load(const c10::BFloat16* p, int64_t left) {
  if (left >= 32) return bf16x32_load(p);
  alignas(32) c10::BFloat16 buf[32];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, sizeof(c10::BFloat16) * left);
  return bf16x32_load(static_cast<const c10::BFloat16*>(buf));
}
// Every pair = (bits & 0xffff, bits >> 16): one bf16 pair broadcast to all 16 lanes (even value in the low half).
inline BF16x32 bf16x32_set1_pair(uint32_t bits) {
  const __m256i v = _mm256_set1_epi32(static_cast<int>(bits));
  return {v, v};
}
namespace avx2_detail {
// vdpbf16ps on 8 lanes: acc + odd(a) * odd(b), then + even(a) * even(b); bf16 products are exact in fp32,
// so each step is one FMA.
inline __m256 dot_bf16x8(__m256 acc, __m256i a, __m256i b) {
  const __m256i hi16 = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256 a_odd = _mm256_castsi256_ps(_mm256_and_si256(a, hi16)), b_odd = _mm256_castsi256_ps(_mm256_and_si256(b, hi16));
  const __m256 a_even = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), b_even = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
  return _mm256_fmadd_ps(a_even, b_even, _mm256_fmadd_ps(a_odd, b_odd, acc));
}
}  // namespace avx2_detail
// Lane i: acc + a[2i+1] * b[2i+1] + a[2i] * b[2i], rounded after each add (vdpbf16ps's order).
inline VecF vdot_bf16(VecF acc, BF16x32 a, BF16x32 b) {
  return {avx2_detail::dot_bf16x8(acc.lo, a.lo, b.lo), avx2_detail::dot_bf16x8(acc.hi, a.hi, b.hi)};
}
// Element-wise pairs of two 32-value rows: lo = (a[k], b[k]) for k = 0..15 in order, hi = k = 16..31 (the
// AVX-512 backend's bf16x32_zip; the in-lane unpacks give dims 0-3, 8-11 / 4-7, 12-15, the lane swap orders them).
inline void bf16x32_zip(BF16x32 a, BF16x32 b, BF16x32& lo, BF16x32& hi) {
  const auto zip16 = [](__m256i x, __m256i y, __m256i& first, __m256i& second) {
    const __m256i l = _mm256_unpacklo_epi16(x, y), h = _mm256_unpackhi_epi16(x, y);
    first = _mm256_permute2x128_si256(l, h, 0x20);
    second = _mm256_permute2x128_si256(l, h, 0x31);
  };
  zip16(a.lo, b.lo, lo.lo, lo.hi);
  zip16(a.hi, b.hi, hi.lo, hi.hi);
}
// 16 pairs to dst (dword i = bf16(even[i]) | bf16(odd[i]) << 16, rounded to nearest even): what
// bf16x32_load reads back as the operand of vdot_bf16.
inline void vstore_bf16_pairs(uint32_t* dst, VecF even, VecF odd) {
  using avx2_detail::f32_to_bf16x8;
  const __m256i lo = _mm256_or_si256(f32_to_bf16x8(even.lo), _mm256_slli_epi32(f32_to_bf16x8(odd.lo), 16));
  const __m256i hi = _mm256_or_si256(f32_to_bf16x8(even.hi), _mm256_slli_epi32(f32_to_bf16x8(odd.hi), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8), hi);
}

}  // namespace pagellm::cpu
