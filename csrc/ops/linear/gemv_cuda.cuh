// linear_small_m on the GPU: a weight-streaming GEMV for decode (few rows of x). Torch-free.
//
// A decode step's linears read every weight once for a handful of rows: bound by memory, and for the ~8-30 MB
// matrices of a 1B model by the latency of getting enough loads in flight. cuBLAS reached 0.35-0.59 of the
// H200's copy bandwidth on the 1B model's o / qkv / down projections at M = 1 (session 17,
// benchmarks/results/gpu-h200-session17): its tiles are built for larger M.
// grid = (ceil(N / 8), ceil(M / MR)), block = 256 threads (8 warps). Warp w of CTA x computes output column
// n = 8x + w for the MR rows m0 .. m0 + MR - 1 of x: lane l reads the weight row's 16-byte vectors l, l + 32, ...
// (coalesced), kUnroll of them issued before the first is used, multiplies them by the same vectors of the x rows
// (read through L1/L2: every warp reads them), sums in fp32 and reduces with shuffles (a fixed order: the
// result does not depend on the grid). Rows not a multiple of the vector width, or misaligned, take a scalar
// path with the same structure.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/vec.cuh"
#include "ops/linear/gemv_launch.h"

namespace pagellm::cuda {

constexpr int kGemvWarps = 8;
constexpr int kGemvUnroll = 8;  // weight vectors a lane has in flight

template <typename T, int MR, bool kVectorized>
__global__ void __launch_bounds__(kGemvWarps * 32) linear_gemv_kernel(const GemvArgs a) {
  constexpr int kVec = VecTraits<T>::kElems;
  const int lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5);
  if (n >= a.N) return;  // whole warps: no shuffle partner leaves
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * MR;
  const int mr = static_cast<int>(a.M - m0 < MR ? a.M - m0 : MR);
  const T* __restrict__ w = static_cast<const T*>(a.w) + n * a.w_stride;
  const T* __restrict__ x = static_cast<const T*>(a.x) + m0 * a.x_stride;
  float acc[MR];
#pragma unroll
  for (int m = 0; m < MR; ++m) acc[m] = 0.f;
  if constexpr (kVectorized) {
    constexpr int kStep = 32 * kVec;
    for (int64_t k0 = static_cast<int64_t>(lane) * kVec; k0 < a.K; k0 += kStep * kGemvUnroll) {
      Vec16<T> wv[kGemvUnroll];
#pragma unroll
      for (int u = 0; u < kGemvUnroll; ++u)
        if (k0 + u * kStep < a.K) wv[u] = load16<T>(w + k0 + u * kStep);
#pragma unroll
      for (int u = 0; u < kGemvUnroll; ++u) {
        const int64_t k = k0 + u * kStep;
        if (k >= a.K) break;
#pragma unroll
        for (int m = 0; m < MR; ++m) {
          if (m < mr) {
            const Vec16<T> xv = load16<T>(x + m * a.x_stride + k);
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[m] = fmaf(to_float(wv[u].elem[e]), to_float(xv.elem[e]), acc[m]);
          }
        }
      }
    }
  } else {
    for (int64_t k = lane; k < a.K; k += 32) {
      const float wk = to_float(w[k]);
#pragma unroll
      for (int m = 0; m < MR; ++m)
        if (m < mr) acc[m] = fmaf(wk, to_float(x[m * a.x_stride + k]), acc[m]);
    }
  }
  const float b = a.bias != nullptr ? to_float(static_cast<const T*>(a.bias)[n]) : 0.f;
  T* __restrict__ out = static_cast<T*>(a.out) + m0 * a.o_stride + n;
#pragma unroll
  for (int m = 0; m < MR; ++m) {
    const float s = warp_reduce_sum(acc[m]);
    if (lane == 0 && m < mr) out[m * a.o_stride] = from_float<T>(s + b);
  }
}

template <typename T, int MR>
cudaError_t gemv_rows(const GemvArgs& a, bool vectorized, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>((a.N + kGemvWarps - 1) / kGemvWarps), static_cast<unsigned>((a.M + MR - 1) / MR));
  if (vectorized) linear_gemv_kernel<T, MR, true><<<grid, kGemvWarps * 32, 0, s>>>(a);
  else linear_gemv_kernel<T, MR, false><<<grid, kGemvWarps * 32, 0, s>>>(a);
  return cudaGetLastError();
}

inline bool host_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T>
cudaError_t gemv_typed(const GemvArgs& a, cudaStream_t s) {
  constexpr int kVec = VecTraits<T>::kElems;
  const bool vectorized = a.K % kVec == 0 && a.x_stride % kVec == 0 && a.w_stride % kVec == 0 &&
                          host_aligned16(a.x) && host_aligned16(a.w);
  if (a.M == 1) return gemv_rows<T, 1>(a, vectorized, s);
  if (a.M == 2) return gemv_rows<T, 2>(a, vectorized, s);
  if (a.M <= 4) return gemv_rows<T, 4>(a, vectorized, s);
  return gemv_rows<T, 8>(a, vectorized, s);
}

}  // namespace pagellm::cuda
