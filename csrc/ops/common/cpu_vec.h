// A 16-lane fp32 vector used by every CPU kernel, with one backend per instruction set the compiler targets:
// AVX-512 (cpu_vec_avx512.h), AVX2 + FMA + F16C (cpu_vec_avx2.h, bit-identical to the AVX-512 one on normal
// numbers: same operations, same order, same reduction trees) or plain arrays (cpu_vec_scalar.h). Loads/stores
// convert from/to float, c10::BFloat16 (round-to-nearest-even) and c10::Half; `n`-variants touch only n < 16
// lanes. PAGELLM_BF16_DOT (AVX512-BF16 or AVX2): BF16x32 + vdot_bf16, the vdpbf16ps pair dot product.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pagellm::cpu {
constexpr int kLanes = 16;
}  // namespace pagellm::cpu

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define PAGELLM_AVX512 1
#include "ops/common/cpu_vec_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGELLM_AVX2 1
#include "ops/common/cpu_vec_avx2.h"
#else
#include "ops/common/cpu_vec_scalar.h"
#endif

namespace pagellm::cpu {


// vround<T>(a): a rounded to T and back.
template <typename T>
inline VecF vround(VecF a) { return vround(a, static_cast<T*>(nullptr)); }

// tanh(x) = sign(x) (1 - t) / (1 + t), t = exp(-2|x|); absolute error ~1e-7.
inline VecF vtanh(VecF x) {
  VecF t = vexp(vmul(vabs(x), vset1(-2.0f)));
  VecF one = vset1(1.0f);
  return vcopysign(vdiv(vsub(one, t), vadd(one, t)), x);
}

// erf(x), Abramowitz & Stegun 7.1.26 (absolute error < 1.5e-7).
inline VecF verf(VecF x) {
  VecF ax = vabs(x);
  VecF one = vset1(1.0f);
  VecF t = vdiv(one, vfma(vset1(0.3275911f), ax, one));
  VecF p = vset1(1.061405429f);
  p = vfma(p, t, vset1(-1.453152027f));
  p = vfma(p, t, vset1(1.421413741f));
  p = vfma(p, t, vset1(-0.284496736f));
  p = vfma(p, t, vset1(0.254829592f));
  p = vmul(p, t);
  VecF e = vexp(vmul(vmul(ax, ax), vset1(-1.0f)));
  return vcopysign(vsub(one, vmul(p, e)), x);
}

// Software prefetch of `bytes` starting at p (paged rows defeat the hardware prefetcher at block edges).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// Converts n contiguous values to fp32 (scaled), vectorized with a masked tail.
template <typename T>
inline void load_row_f32(const T* src, float* dst, int64_t n, float scale = 1.0f) {
  VecF s = vset1(scale);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(dst + i, vmul(vload(src + i), s));
  if (i < n) vstore(dst + i, vmul(vload(src + i, static_cast<int>(n - i)), s), static_cast<int>(n - i));
}

template <typename T>
inline void store_row(const float* src, T* dst, int64_t n, float scale = 1.0f) {
  VecF s = vset1(scale);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(dst + i, vmul(vload(src + i), s));
  if (i < n) vstore(dst + i, vmul(vload(src + i, static_cast<int>(n - i)), s), static_cast<int>(n - i));
}

}  // namespace pagellm::cpu
