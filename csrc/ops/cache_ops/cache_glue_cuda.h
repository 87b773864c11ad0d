// Argument checks of the CUDA cache-write glue (cache_ops_cuda.cpp), shared with the fused rope + cache write
// (ops/fused/rope_cache_cuda.cpp). Glue only (includes torch).
#pragma once
#include <ATen/ATen.h>

#include "ops/cache_ops/cache_launch.h"

namespace pagellm::cuda {

// Checks key/value [T, H, D] against the caches [num_blocks, H, block_size, D] and slot_mapping (int64 [T],
// contiguous); fills everything of the result but the type fields (elem_size, scales). Messages name the argument.
ReshapeAndCacheArgs check_cache_write(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                      const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots);

}  // namespace pagellm::cuda
