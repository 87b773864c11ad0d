// Host-side, torch-free entry points of the awq_linear CUDA kernels (implemented in awq_linear_kernels.cu).
// Weight layout: awq_layout.h (qweight uint8 [N, K / 2], scales float32 / zeros uint8 [N, K / group_size]).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/dtype.h"

namespace pagellm::cuda {

// out[m, n] (row stride ldo) = sum_k x[m, k] (row stride ldx) * W[n, k] (+ bias[n]) for m < M, n < N: the
// small-M GEMV (one warp per n). K a multiple of 32, group_size a multiple of 32 dividing K; qweight
// 16-byte aligned and contiguous; x, out, bias (may be null) in `dtype`. cudaErrorInvalidValue on bad sizes.
cudaError_t launch_awq_linear(void* out, const void* x, const uint8_t* qweight, const float* scales,
                              const uint8_t* zeros, const void* bias, int64_t M, int64_t N, int64_t K,
                              int64_t group_size, int64_t ldx, int64_t ldo, DType dtype, cudaStream_t stream);

// dst[r, k] (row stride ldd, `dtype`) = W[r, k] for r < rows (qweight / scales / zeros point at row 0):
// the weight of the large-M path, expanded for a GEMM.
cudaError_t launch_awq_dequantize(void* dst, const uint8_t* qweight, const float* scales, const uint8_t* zeros,
                                  int64_t rows, int64_t K, int64_t group_size, int64_t ldd, DType dtype,
                                  cudaStream_t stream);

}  // namespace pagellm::cuda
