// Argument checks of the CUDA rotary-embedding glue (norm_rope_cuda.cpp), shared with the fused rope + cache write
// (ops/fused/rope_cache_cuda.cpp). Glue only (includes torch).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

#include "ops/norm_rope/norm_launch.h"

namespace pagellm::cuda {

// (num_heads, token stride, head stride) of a [T, H*D] or [T, H, D] query / key (checked; `name` in messages).
std::tuple<int64_t, int64_t, int64_t> head_geometry(const at::Tensor& t, int64_t T, int64_t head_size,
                                                    const char* name);

// Checks rotary_embedding's arguments (messages name them) and returns its launch arguments (is_neox false: the
// caller sets it). positions_held: the contiguous positions the arguments point into (keep it until the launch).
RotaryArgs check_rotary_args(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, int64_t head_size,
                             const at::Tensor& cos_sin_cache, at::Tensor& positions_held);

}  // namespace pagellm::cuda
