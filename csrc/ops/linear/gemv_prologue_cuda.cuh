// Prologues of the split-K GEMV (gemv_split_cuda.cuh, GemvPrologue in gemv_launch.h): a CTA computes its row of the
// product's input from x into shared memory, so the norm / activation kernel before the linear is not launched.
// Torch-free. Each CTA recomputes the row (K elements: a few KiB read from the L2), which costs less than a kernel
// boundary in a batch-1 decode step. The arithmetic is rms_norm_cuda.cuh's / activation_cuda.cuh's, in the order of
// their 16-byte-vector kernels, so the staged row has the bits those kernels write.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/activation/activation_cuda.cuh"
#include "ops/cuda_common/vec.cuh"
#include "ops/linear/gemv_launch.h"
#include "ops/norm_rope/rms_norm_cuda.cuh"

namespace pagellm::cuda {

constexpr int64_t kGemvPrologueMaxBytes = 40 * 1024;  // the staged row (K * sizeof(T)) fits the static 48 KiB

// Stages row m of the product's input (K elements) into xs (shared memory, 16-byte aligned); ends with a barrier.
// The norms' sum of squares follows rms_norm_kernel at rms_norm_threads(K / W) threads: VT virtual threads, a
// multiple of blockDim.x, each real thread playing VT / blockDim.x of them (virtual thread j * blockDim.x + tid:
// vectors from it in steps of VT, then block_reduce_sum's two shuffle stages over the virtual warps).
template <typename T, GemvPrologue P>
__device__ __forceinline__ void gemv_stage_row(const GemvArgs& a, const GemvPrologueArgs& pa, int64_t m, T* xs) {
  constexpr int W = VecTraits<T>::kElems;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int64_t n = a.K / W;
  const T* x = static_cast<const T*>(a.x) + m * a.x_stride;
  if constexpr (P == GemvPrologue::kSiluMul) {
    for (int64_t i = tid; i < n; i += nthreads) {
      const Vec16<T> g = load16<T>(x + i * W), u = load16<T>(x + a.K + i * W);
      Vec16<T> o;
#pragma unroll
      for (int e = 0; e < W; ++e) o.elem[e] = gated<T, GateAct::kSilu>(g.elem[e], u.elem[e]);
      store16<T>(xs + i * W, o);
    }
  } else {
    static_assert(P == GemvPrologue::kRmsNorm || P == GemvPrologue::kAddRmsNorm, "unknown prologue");
    __shared__ float partial[32];
    const int lane = tid & 31, warp = tid >> 5, warps = nthreads >> 5;
    const int VT = rms_norm_threads(n), reps = VT / nthreads;
    const T* res = nullptr;
    T* res_out = nullptr;
    if constexpr (P == GemvPrologue::kAddRmsNorm) {
      res = static_cast<const T*>(pa.residual) + m * pa.res_stride;
      if (blockIdx.x == 0) res_out = static_cast<T*>(pa.residual_out) + m * pa.res_out_stride;  // one CTA per row
    }
    for (int j = 0; j < reps; ++j) {
      float sq = 0.f;
      for (int64_t i = j * nthreads + tid; i < n; i += VT) {
        Vec16<T> v = load16<T>(x + i * W);
        if constexpr (P == GemvPrologue::kAddRmsNorm) {
          const Vec16<T> b = load16<T>(res + i * W);
#pragma unroll
          for (int e = 0; e < W; ++e) v.elem[e] = from_float<T>(to_float(v.elem[e]) + to_float(b.elem[e]));
          if (res_out != nullptr) store16<T>(res_out + i * W, v);
        }
#pragma unroll
        for (int e = 0; e < W; ++e) sq = rms_accumulate(sq, to_float(v.elem[e]));
        store16<T>(xs + i * W, v);
      }
      for (int off = 16; off > 0; off >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
      if (lane == 0) partial[j * warps + warp] = sq;
    }
    __syncthreads();
    float total = lane < (VT >> 5) ? partial[lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
    const float inv = rms_inverse(total, a.K, pa.eps);
    const T* nw = static_cast<const T*>(pa.norm_weight);
    for (int64_t i = tid; i < n; i += nthreads) {  // the vectors this thread staged: no barrier needed before
      const Vec16<T> r = load16<T>(xs + i * W), w = load16<T>(nw + i * W);
      Vec16<T> o;
#pragma unroll
      for (int e = 0; e < W; ++e) o.elem[e] = rms_scale<T>(r.elem[e], w.elem[e], inv);
      store16<T>(xs + i * W, o);
    }
  }
  __syncthreads();
}

}  // namespace pagellm::cuda
