// Host-side, torch-free entry points of the activation CUDA kernels (implemented in activation_kernels.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/dtype.h"

namespace pagellm::cuda {

enum class GateActKind { kSilu, kGelu, kGeluTanh };

// out[r, :d] = act(in[r, :d]) * in[r, d:2d] for r < num_rows; row r of out at r * out_row_stride, of in at
// r * in_row_stride (elements); each row contiguous. 16-byte vectors when d and the row addresses allow it.
cudaError_t launch_act_and_mul(void* out, const void* in, int64_t num_rows, int64_t d, int64_t out_row_stride,
                               int64_t in_row_stride, DType dtype, GateActKind act, cudaStream_t stream);

}  // namespace pagellm::cuda
