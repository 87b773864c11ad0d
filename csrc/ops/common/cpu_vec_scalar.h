// Portable backend of VecF: plain arrays (included by cpu_vec.h when neither AVX-512 nor AVX2 is targeted).
// Reductions use the SIMD backends' trees; exp is std::exp (not their polynomial).
#pragma once

namespace pagellm::cpu {

struct VecF {
  float v[kLanes];
};

#define PAGELLM_VEC_MAP(expr)                  \
  VecF r;                                      \
  for (int i = 0; i < kLanes; ++i) r.v[i] = expr; \
  return r

inline VecF vzero() { PAGELLM_VEC_MAP(0.f); }
inline VecF vset1(float x) { PAGELLM_VEC_MAP(x); }
inline VecF vadd(VecF a, VecF b) { PAGELLM_VEC_MAP(a.v[i] + b.v[i]); }
inline VecF vsub(VecF a, VecF b) { PAGELLM_VEC_MAP(a.v[i] - b.v[i]); }
inline VecF vmul(VecF a, VecF b) { PAGELLM_VEC_MAP(a.v[i] * b.v[i]); }
inline VecF vdiv(VecF a, VecF b) { PAGELLM_VEC_MAP(a.v[i] / b.v[i]); }
inline VecF vmax(VecF a, VecF b) { PAGELLM_VEC_MAP(std::max(a.v[i], b.v[i])); }
inline VecF vmin(VecF a, VecF b) { PAGELLM_VEC_MAP(std::min(a.v[i], b.v[i])); }
inline VecF vfma(VecF a, VecF b, VecF c) { PAGELLM_VEC_MAP(std::fma(a.v[i], b.v[i], c.v[i])); }
inline VecF vabs(VecF a) { PAGELLM_VEC_MAP(std::fabs(a.v[i])); }
inline VecF vswap_pairs(VecF a) { PAGELLM_VEC_MAP(a.v[i ^ 1]); }
inline VecF vcopysign(VecF a, VecF s) { PAGELLM_VEC_MAP(std::copysign(a.v[i], s.v[i])); }
inline VecF vselect_lt(VecF l, VecF r_, VecF a, VecF b) { PAGELLM_VEC_MAP(l.v[i] < r_.v[i] ? a.v[i] : b.v[i]); }
inline VecF vexp(VecF x) { PAGELLM_VEC_MAP(x.v[i] < -87.0f ? 0.f : std::exp(x.v[i])); }
inline VecF vexp_lowp(VecF x) { return vexp(x); }
// The AVX-512 backend's reduction tree (halves, quarters, then 0+2 / 1+3, then 0+1).
inline float vsum(VecF a) {
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = a.v[i + 8] + a.v[i];
  for (int i = 0; i < 4; ++i) q[i] = h[i + 4] + h[i];
  return (q[0] + q[2]) + (q[1] + q[3]);
}
inline float vmaxall(VecF a) { return *std::max_element(a.v, a.v + kLanes); }
// vsum16's tree: per 4-lane group (0+2) + (1+3), then groups (0+1) + (2+3).
inline float vsum_quads(const VecF& a) {
  float g[4];
  for (int q = 0; q < 4; ++q) g[q] = (a.v[4 * q] + a.v[4 * q + 2]) + (a.v[4 * q + 1] + a.v[4 * q + 3]);
  return (g[0] + g[1]) + (g[2] + g[3]);
}
inline VecF vsum16(const VecF* v) { PAGELLM_VEC_MAP(vsum_quads(v[i])); }
template <typename T>
inline VecF vload(const T* p, int n = kLanes) { PAGELLM_VEC_MAP(i < n ? static_cast<float>(p[i]) : 0.f); }
template <typename T>
inline void vstore(T* p, VecF a, int n = kLanes) {
  for (int i = 0; i < n; ++i) p[i] = static_cast<T>(a.v[i]);
}
template <typename T>
inline VecF vround(VecF a, T*) { PAGELLM_VEC_MAP(static_cast<float>(static_cast<T>(a.v[i]))); }
#undef PAGELLM_VEC_MAP

}  // namespace pagellm::cpu
