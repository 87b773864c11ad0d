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

// The pieces every RMSNorm on the GPU is made of (these kernels, and the norm folded into a GEMV's prologue in
// ops/linear/gemv_prologue_cuda.cuh), with the arithmetic pinned so that both give the same bits:
// the block size for a row of `units` loads (vectors or elements), which fixes the order of the sum of squares;
__host__ __device__ constexpr int rms_norm_threads(int64_t units) {
  return units >= 4096 ? 1024 : (units >= 1024 ? 512 : 256);
}
// one step of the sum of squares;
__device__ __forceinline__ float rms_accumulate(float sq, float f) { return __fmaf_rn(f, f, sq); }
// 1 / rms from the row's sum of squares;
__device__ __forceinline__ float rms_inverse(float sum_sq, int64_t hidden, float eps) {
  return rsqrtf(sum_sq / static_cast<float>(hidden) + eps);
}
// one output element: normalized and rounded to T, then times the weight and rounded (HF's order).
template <typename T>
__device__ __forceinline__ T rms_scale(T x, T w, float inv) {
  return from_float<T>(to_float(from_float<T>(to_float(x) * inv)) * to_float(w));
}

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
      for (int e = 0; e < W; ++e) sq = rms_accumulate(sq, to_float(v.elem[e]));
    } else {
      sq = rms_accumulate(sq, to_float(x[i]));
    }
  }
  const float inv = rms_inverse(block_reduce_sum(sq), hidden, eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if constexpr (kVecIO) {
      const Vec16<T> v = load16<T>(x + i * W), w = load16<T>(weight + i * W);
      Vec16<T> o;
#pragma unroll
      for (int e = 0; e < W; ++e) o.elem[e] = rms_scale<T>(v.elem[e], w.elem[e], inv);
      store16<T>(y + i * W, o);
    } else {
      y[i] = rms_scale<T>(x[i], weight[i], inv);
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
        sq = rms_accumulate(sq, to_float(sum.elem[e]));
      }
      store16<T>(rr + i * W, sum);
    } else {
      const T sum = from_float<T>(to_float(xr[i]) + to_float(rr[i]));
      rr[i] = sum;
      sq = rms_accumulate(sq, to_float(sum));
    }
  }
  const float inv = rms_inverse(block_reduce_sum(sq), hidden, eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if constexpr (kVecIO) {
      const Vec16<T> r = load16<T>(rr + i * W), w = load16<T>(weight + i * W);
      Vec16<T> o;
#pragma unroll
      for (int e = 0; e < W; ++e) o.elem[e] = rms_scale<T>(r.elem[e], w.elem[e], inv);
      store16<T>(xr + i * W, o);
    } else {
      xr[i] = rms_scale<T>(rr[i], weight[i], inv);
    }
  }
}

}  // namespace pagellm::cuda
