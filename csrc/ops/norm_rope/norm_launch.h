// Host-side, torch-free entry points of the RMSNorm CUDA kernels (implemented in norm_kernels.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda_common/dtype.h"

namespace pagellm::cuda {

// out[r] = rmsnorm(in[r]) * weight for r < num_rows; rows may be strided, the hidden dim is contiguous.
cudaError_t launch_rms_norm(void* out, const void* in, const void* weight, int64_t num_rows, int64_t hidden,
                            int64_t in_row_stride, int64_t out_row_stride, float eps, DType dtype, cudaStream_t stream);

// residual[r] += x[r]; x[r] = rmsnorm(residual[r]) * weight, in place.
cudaError_t launch_fused_add_rms_norm(void* x, void* residual, const void* weight, int64_t num_rows, int64_t hidden,
                                      int64_t x_row_stride, int64_t res_row_stride, float eps, DType dtype,
                                      cudaStream_t stream);

// Rotary embedding in place. Element d of head h of token t: query[t * query_stride + h * query_head_stride + d];
// key likewise (key may be null with num_k_heads = 0). cos_sin_cache row p at p * cache_stride: rot_dim values
// cos | sin. Tokens whose position is outside [0, max_position) are left unchanged.
struct RotaryArgs {
  const int64_t* positions;
  void* query;
  void* key;
  const void* cos_sin_cache;
  int64_t num_tokens;
  int64_t query_stride, query_head_stride, key_stride, key_head_stride, cache_stride;  // in elements
  int num_q_heads, num_k_heads, head_size, rot_dim;
  int64_t max_position;
  bool is_neox;
};
cudaError_t launch_rotary_embedding(const RotaryArgs& args, DType dtype, DType cache_dtype, cudaStream_t stream);

}  // namespace pagellm::cuda
