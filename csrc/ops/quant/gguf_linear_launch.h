// Host-side, torch-free entry point of the gguf_linear CUDA kernel (implemented in gguf_linear_kernels.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/dtype.h"

namespace pagellm::cuda {

// out[m, n] (row stride ldo) = sum_k x[m, k] (row stride ldx) * dequant(qweight row n)[k] (+ bias[n]) for m < M,
// n < N; K a multiple of block_elems(qtype); qweight rows are row_bytes = K / block_elems * block_bytes(qtype) apart,
// 2-byte aligned. qtype: gguf::kQ4_0, kQ4_1, kQ8_0, kQ4_K or kQ6_K (cudaErrorInvalidValue otherwise). x, out, bias (may be null) in `dtype`.
cudaError_t launch_gguf_linear(void* out, const void* x, const uint8_t* qweight, const void* bias, int64_t M,
                               int64_t N, int64_t K, int64_t ldx, int64_t ldo, int64_t row_bytes, int qtype,
                               DType dtype, cudaStream_t stream);

}  // namespace pagellm::cuda
