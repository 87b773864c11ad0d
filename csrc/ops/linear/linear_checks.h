// Device-independent argument checks of linear_small_m / linear_amx / linear_argmax's product
// out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), shared by the CPU and CUDA glue (each glue checks its
// devices first). Every failure names the offending argument.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "ops/common/arg_checks.h"

namespace pagellm::linear {

// Checks dtypes (x float; weight, out and bias of x's dtype), ranks and shapes, and out's contiguous last dim;
// returns the contiguous bias, or an undefined tensor when there is none.
inline at::Tensor check_linear_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias) {
  check_float(x, "x");
  check_same_dtype(weight, x, "weight", "x");
  check_same_dtype(out, x, "out", "x");
  check_dim(x, 2, "x");
  check_dim(weight, 2, "weight");
  check_dim(out, 2, "out");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight must have shape [N, ", K, "] (K of x), got ", weight.sizes());
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must have shape [", M, ", ", N, "], got ", out.sizes());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = *bias;
    check_same_dtype(b, x, "bias", "x");
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, "bias must have shape [", N, "], got ", b.sizes());
    b = b.contiguous();
  }
  check_last_contiguous(out, "out");
  return b;
}

}  // namespace pagellm::linear
