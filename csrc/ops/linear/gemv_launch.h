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

cudaError_t launch_linear_gemv(const GemvArgs& args, DType dtype, cudaStream_t stream);

}  // namespace pagellm::cuda
