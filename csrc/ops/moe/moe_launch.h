// Host-side, torch-free entry point of the fused_moe CUDA kernels (implemented in moe_kernels.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/dtype.h"
#include "ops/moe/moe_activation.h"

namespace pagellm::cuda {

// Device scratch of one call, P = T * k pairs (the glue allocates it).
struct MoeWorkspace {
  int32_t* offsets;        // [E + 1]: expert e's pairs sit at positions [offsets[e], offsets[e + 1])
  int32_t* pair_token;     // [P]: the token of the pair at each position
  int32_t* pair_position;  // [P]: the position of pair (t, j) at t * k + j; -1 for an id outside [0, E)
  float* gate_up;          // [P, 2I]
  float* act;              // [P, I]
  float* expert_out;       // [P, H]
};

// Sizes and strides of one call: hidden [T, H] (row stride ld_hidden), w13 [E, 2I, H] and w2 [E, H, I]
// contiguous, topk_weights float32 / topk_ids int32 [T, k] contiguous, out [T, H] (row stride ld_out).
struct MoeProblem {
  int64_t T, H, E, I, k;
  int64_t ld_hidden, ld_out;
};

// out = fused_moe(hidden, w13, w2, topk_weights, topk_ids) (contract: python/pagellm/ops/moe_reference.py);
// pairs with an id outside [0, E) contribute nothing. hidden, w13, w2, out in `dtype`. Asynchronous on `stream`;
// cudaErrorInvalidValue on bad sizes (P or E beyond int32).
cudaError_t launch_fused_moe(void* out, const void* hidden, const void* w13, const void* w2, const float* topk_weights,
                             const int32_t* topk_ids, const MoeProblem& problem, MoeActivation activation,
                             const MoeWorkspace& ws, DType dtype, cudaStream_t stream);

}  // namespace pagellm::cuda
