// Host-side, torch-free entry points of the fused decode-step kernels: each does the work of two ops in one launch
// (a batch-1 decode step is a chain of kernels of a few microseconds each, whose launch gaps are most of its
// time). Bits equal those of the ops composed (tests/ops/test_fused_cuda.py).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cache_ops/cache_launch.h"
#include "ops/cuda_common/dtype.h"
#include "ops/norm_rope/norm_launch.h"

namespace pagellm::cuda {

// rotary_embedding(rope) then reshape_and_cache(cache) in one kernel: query and key rotated in place, the rotated
// key rows and the value rows written to the paged cache at the slots. rope.key and cache.key are the same rows
// (cache.key unused); rope.num_k_heads == cache.num_kv_heads, rope.head_size == cache.head_dim;
// rope.num_tokens == cache.num_tokens. dtype: query / key / value / cache; cos_sin_dtype: fp32 or dtype.
cudaError_t launch_rotary_embedding_and_cache(const RotaryArgs& rope, const ReshapeAndCacheArgs& cache, DType dtype,
                                              DType cos_sin_dtype, cudaStream_t stream);

}  // namespace pagellm::cuda
