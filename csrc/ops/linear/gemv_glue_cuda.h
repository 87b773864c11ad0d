// Argument checks of the CUDA GEMV glue (linear_cuda.cpp), shared with the GEMVs that fold a norm or an
// activation into their prologue (ops/fused/norm_act_gemv_cuda.cpp). Glue only (includes torch).
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "ops/linear/gemv_launch.h"

namespace pagellm::cuda {

// Contiguous copies (when the inputs were not) that must outlive the launch.
struct GemvInputs {
  at::Tensor x, weight, bias;
};

// Checks out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]) (devices, dtypes, shapes; messages name the argument)
// and returns the launch arguments; nullopt when out is empty.
std::optional<GemvArgs> gemv_args(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, GemvInputs& held);

}  // namespace pagellm::cuda
