// Host-side, torch-free entry point of the small-M linear CUDA kernel (gemv_kernels.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/dtype.h"

namespace pagellm::cuda {

// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for m < M, n < N: x [M, K] (row stride x_stride), w [N, K]
// (row stride w_stride), out [M, N] (row stride o_stride), bias [N] or null; every row contiguous; fp32 sums.
struct GemvArgs {
  void* out;
  const void* x;
  const void* w;
  const void* bias;
  int64_t M, N, K, x_stride, w_stride, o_stride;
};

// Kernel 1 (gemv_cuda.cuh): one warp per output column.
cudaError_t launch_linear_gemv(const GemvArgs& args, DType dtype, cudaStream_t stream);

// Kernel 2 (gemv_split_cuda.cuh): K split across the warps of a CTA into the fewest slices (1, 2, 4, 8) that make
// at least min_ctas CTAs while a slice keeps >= min_slice_vecs 16-byte vectors; several columns per warp.
// low_regs: half the weight vectors in flight per lane at M <= 2 (more CTAs per SM; same bits). pdl: launch as a
// programmatic dependent of the kernel before it (sm_90; ignored below). Inputs without 16-byte vectors take
// kernel 1.
cudaError_t launch_linear_gemv_split(const GemvArgs& args, DType dtype, int64_t min_ctas, int64_t min_slice_vecs,
                                     bool low_regs, bool pdl, cudaStream_t stream);

}  // namespace pagellm::cuda
