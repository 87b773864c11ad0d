// Gated activations on the GPU: out[..., d] = act(x[..., :d]) * x[..., d:].
// Torch-free: raw pointers + sizes, usable from any host code. One pass, 16-byte vector loads when aligned.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/pdl.cuh"
#include "ops/cuda_common/vec.cuh"

namespace pagellm::cuda {

enum class GateAct { kSilu, kGelu, kGeluTanh };

template <GateAct A>
__device__ __forceinline__ float gate_act(float x) {
  if constexpr (A == GateAct::kSilu) {
    return x / (1.f + __expf(-x));
  } else if constexpr (A == GateAct::kGelu) {
    return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
  } else {
    const float inner = 0.79788456080286536f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.f + tanhf(inner));
  }
}

// Rounded like the torch reference act(x) * y in T: the activation is rounded to T before the product.
template <typename T, GateAct A>
__device__ __forceinline__ T gated(T x, T y) {
  return from_float<T>(to_float(from_float<T>(gate_act<A>(to_float(x)))) * to_float(y));
}

// grid: one block per row (token); block: up to 1024 threads striding over d.
template <typename T, GateAct A>
__global__ void act_and_mul_kernel(T* __restrict__ out, const T* __restrict__ in, int64_t d, int64_t out_row_stride,
                                   int64_t in_row_stride) {
  pdl_launch_dependents();  // the down projection after silu_and_mul may start fetching its weights
  const int64_t row = blockIdx.x;
  const T* x = in + row * in_row_stride;
  const T* y = x + d;
  T* o = out + row * out_row_stride;
  constexpr int kVec = VecTraits<T>::kElems;  // elements per 16-byte load
  const bool aligned = (d % kVec == 0) && is_aligned16(x) && is_aligned16(y) && is_aligned16(o);
  if (aligned) {
    for (int64_t i = threadIdx.x * kVec; i < d; i += blockDim.x * kVec) {
      Vec16<T> xv = load16<T>(x + i), yv = load16<T>(y + i), ov;
#pragma unroll
      for (int j = 0; j < kVec; ++j) ov.elem[j] = gated<T, A>(xv.elem[j], yv.elem[j]);
      store16<T>(o + i, ov);
    }
  } else {
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
      o[i] = gated<T, A>(x[i], y[i]);
    }
  }
}

}  // namespace pagellm::cuda
