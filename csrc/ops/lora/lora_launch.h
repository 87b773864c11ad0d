// Host-side, torch-free entry point of the lora_apply CUDA kernels (implemented in lora_kernels.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/dtype.h"

namespace pagellm::cuda {

// y [T, N] (row stride y_stride) += scales[s_t] * lora_b[s_t] @ (lora_a[s_t] @ x[t]) for token_slots[t] = s_t in
// [0, S); x [T, K] (row stride x_stride); lora_a [S, R, K], lora_b [S, N, R] contiguous; tmp: fp32 scratch [T, R].
cudaError_t launch_lora_apply(void* y, const void* x, const void* lora_a, const void* lora_b, const float* scales,
                              const int32_t* token_slots, float* tmp, int64_t T, int64_t K, int64_t N, int64_t S,
                              int64_t R, int64_t y_stride, int64_t x_stride, DType dtype, cudaStream_t stream);

}  // namespace pagellm::cuda
