// RMSNorm on the GPU, one block per row, fp32 accumulation, HF rounding order:
// y = to_T(x * rsqrt(mean(x^2) + eps)) * w. The fused variant first does residual += x (in T) and
// normalizes the new residual. Torch-free.
// kVecIO: 16-byte loads/stores (the launcher checks hidden, strides and addresses allow it); thread i handles
// vectors i, i + blockDim.x, ... in both passes, so the fused kernel re-reads only what it wrote itself.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/pdl.cuh"
#include "ops/cuda_common/vec.cuh"

namespace pagellm::cuda {

template <typename T, bool kVecIO>
__global__ void rms_norm_kernel(T* __restrict__ out, const T* __restrict__ in, const T* __restrict__ weight,
                                int64_t hidden, int64_t in_row_stride, int64_t out_row_stride, float eps) {
  pdl_launch_dependents();  // a PDL-launched linear after the norm may start fetching its weights
  const T* x = in + blockIdx.x * in_row_stride;
  T* y = out + blockIdx.x * out_row_stride;
  constexpr int W = kVecIO ? VecTraits<T>::kElems : 1;
  const int64_t n = hidden / W;
  float sq = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if constexpr (kVecIO) {
      const Vec16<T> v = load16<T>(x + i * W);
#pragma unroll
      for (int e = 0; e < W; ++e) {
        const float f = to_float(v.elem[e]);
        sq += f * f;
      }
    } else {
      const float f = to_float(x[i]);
      sq += f * f;
    }
  }
  const float inv = rsqrtf(block_reduce_sum(sq) / static_cast<float>(hidden) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if constexpr (kVecIO) {
      const Vec16<T> v = load16<T>(x + i * W), w = load16<T>(weight + i * W);
      Vec16<T> o;
#pragma unroll
      for (int e = 0; e < W; ++e)
        o.elem[e] = from_float<T>(to_float(from_float<T>(to_float(v.elem[e]) * inv)) * to_float(w.elem[e]));
      store16<T>(y + i * W, o);
    } else {
      const T normed = from_float<T>(to_float(x[i]) * inv);
      y[i] = from_float<T>(to_float(normed) * to_float(weight[i]));
    }
  }
}

template <typename T, bool kVecIO>
__global__ void fused_add_rms_norm_kernel(T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight,
                                          int64_t hidden, int64_t x_row_stride, int64_t res_row_stride, float eps) {
  pdl_launch_dependents();
  T* xr = x + blockIdx.x * x_row_stride;
  T* rr = residual + blockIdx.x * res_row_stride;
  constexpr int W = kVecIO ? VecTraits<T>::kElems : 1;
  const int64_t n = hidden / W;
  float sq = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if constexpr (kVecIO) {
      const Vec16<T> a = load16<T>(xr + i * W), b = load16<T>(rr + i * W);
      Vec16<T> sum;
#pragma unroll
      for (int e = 0; e < W; ++e) {
        sum.elem[e] = from_float<T>(to_float(a.elem[e]) + to_float(b.elem[e]));
        const float f = to_float(sum.elem[e]);
        sq += f * f;
      }
      store16<T>(rr + i * W, sum);
    } else {
      const T sum = from_float<T>(to_float(xr[i]) + to_float(rr[i]));
      rr[i] = sum;
      const float f = to_float(sum);
      sq += f * f;
    }
  }
  const float inv = rsqrtf(block_reduce_sum(sq) / static_cast<float>(hidden) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if constexpr (kVecIO) {
      const Vec16<T> r = load16<T>(rr + i * W), w = load16<T>(weight + i * W);
      Vec16<T> o;
#pragma unroll
      for (int e = 0; e < W; ++e)
        o.elem[e] = from_float<T>(to_float(from_float<T>(to_float(r.elem[e]) * inv)) * to_float(w.elem[e]));
      store16<T>(xr + i * W, o);
    } else {
      const T normed = from_float<T>(to_float(rr[i]) * inv);
      xr[i] = from_float<T>(to_float(normed) * to_float(weight[i]));
    }
  }
}

}  // namespace pagellm::cuda
