// RMSNorm (plain and fused with the residual add) and rotary embedding, fp32 math.
// RMSNorm rounds like HF Llama: normalize in fp32, cast to the input dtype, then multiply by weight.
#pragma once

#include "ops/common/parallel.h"

#include "ops/common/cpu_vec.h"

#include <type_traits>

namespace pagellm::cpu {

// Rows per task so that a task moves >= ~64K elements: tiny calls run inline, without waking threads.
inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_elems)); }

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  VecF acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    VecF v = vload(x + i);
    acc = vfma(v, v, acc);
  }
  if (i < n) {
    VecF v = vload(x + i, static_cast<int>(n - i));
    acc = vfma(v, v, acc);
  }
  return vsum(acc);
}

// out = T(x * inv_rms) * w
template <typename T>
inline void scale_row(T* out, const T* x, const T* w, int64_t n, float inv_rms) {
  const VecF s = vset1(inv_rms);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vstore(out + i, vmul(vround<T>(vmul(vload(x + i), s)), vload(w + i)));
  }
  if (i < n) {
    const int m = static_cast<int>(n - i);
    vstore(out + i, vmul(vround<T>(vmul(vload(x + i, m), s)), vload(w + i, m)), m);
  }
}

template <typename T>
void rms_norm_kernel(T* out, const T* x, const T* w, int64_t rows, int64_t n, int64_t out_stride,
                     int64_t x_stride, float eps) {
  pagellm::cpu::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      const float inv = 1.0f / std::sqrt(sum_squares(xr, n) / static_cast<float>(n) + eps);
      scale_row(out + r * out_stride, xr, w, n, inv);
    }
  });
}

// residual = T(residual + x); returns sum of squares of the rounded residual.
template <typename T>
inline float add_residual_row(T* res, const T* x, int64_t n) {
  VecF acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    VecF v = vround<T>(vadd(vload(res + i), vload(x + i)));
    vstore(res + i, v);
    acc = vfma(v, v, acc);
  }
  if (i < n) {
    const int m = static_cast<int>(n - i);
    VecF v = vround<T>(vadd(vload(res + i, m), vload(x + i, m)));
    vstore(res + i, v, m);
    acc = vfma(v, v, acc);
  }
  return vsum(acc);
}

template <typename T>
void fused_add_rms_norm_kernel(T* x, T* res, const T* w, int64_t rows, int64_t n, int64_t x_stride,
                               int64_t res_stride, float eps) {
  pagellm::cpu::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* rr = res + r * res_stride;
      T* xr = x + r * x_stride;
      const float inv = 1.0f / std::sqrt(add_residual_row(rr, xr, n) / static_cast<float>(n) + eps);
      scale_row(xr, rr, w, n, inv);
    }
  });
}

// ---- rotary embedding ----

struct RopeArgs {
  const int64_t* positions;
  int64_t num_tokens, num_q_heads, num_k_heads, rot_dim;
  int64_t q_stride_t, q_stride_h, k_stride_t, k_stride_h, cache_stride;
  bool is_neox;
};

// NeoX: x[i], x[i + rot/2] rotate together by (cos[i], sin[i]).
template <typename T>
inline void rope_neox_head(T* x, const float* cs, const float* sn, int64_t half) {
  for (int64_t i = 0; i < half; i += kLanes) {
    const int m = static_cast<int>(std::min<int64_t>(kLanes, half - i));
    VecF x1 = vload(x + i, m), x2 = vload(x + half + i, m);
    VecF c = vload(cs + i, m), s = vload(sn + i, m);
    vstore(x + i, vsub(vmul(x1, c), vmul(x2, s)), m);
    vstore(x + half + i, vfma(x1, s, vmul(x2, c)), m);
  }
}

// GPT-J: pairs (x[2j], x[2j+1]); ce/se are cos/sin expanded per lane, se = (-sin, +sin, ...).
template <typename T>
inline void rope_gptj_head(T* x, const float* ce, const float* se, int64_t rot) {
  for (int64_t i = 0; i < rot; i += kLanes) {
    const int m = static_cast<int>(std::min<int64_t>(kLanes, rot - i));
    VecF v = vload(x + i, m);
    vstore(x + i, vfma(vswap_pairs(v), vload(se + i, m), vmul(v, vload(ce + i, m))), m);
  }
}

template <typename T, typename C>
void rotary_embedding_kernel(const RopeArgs& a, T* q, T* k, const C* cache) {
  pagellm::cpu::parallel_for(0, a.num_tokens, row_grain((a.num_q_heads + a.num_k_heads) * a.rot_dim), [&](int64_t begin, int64_t end) {
    float cbuf[512], sbuf[512];  // rot_dim <= 512 (checked by the caller)
    const int64_t half = a.rot_dim / 2;
    for (int64_t t = begin; t < end; ++t) {
      const C* row = cache + a.positions[t] * a.cache_stride;
      const float* cs = cbuf;
      const float* sn = sbuf;
      if (std::is_same_v<C, float> && a.is_neox) {  // the fp32 cache row is already (cos..., sin...): no copy
        cs = reinterpret_cast<const float*>(row), sn = reinterpret_cast<const float*>(row) + half;
      } else {
        for (int64_t i = 0; i < half; ++i) {
          const float c = static_cast<float>(row[i]), s = static_cast<float>(row[half + i]);
          if (a.is_neox) {
            cbuf[i] = c, sbuf[i] = s;
          } else {
            cbuf[2 * i] = cbuf[2 * i + 1] = c;
            sbuf[2 * i] = -s, sbuf[2 * i + 1] = s;
          }
        }
      }
      for (int64_t h = 0; h < a.num_q_heads + a.num_k_heads; ++h) {
        T* x = h < a.num_q_heads ? q + t * a.q_stride_t + h * a.q_stride_h
                                 : k + t * a.k_stride_t + (h - a.num_q_heads) * a.k_stride_h;
        if (a.is_neox) {
          rope_neox_head(x, cs, sn, half);
        } else {
          rope_gptj_head(x, cs, sn, a.rot_dim);
        }
      }
    }
  });
}

}  // namespace pagellm::cpu
