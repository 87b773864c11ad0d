// Device-independent argument checks of int8_linear, shared by the CPU and CUDA glue. Every failure names
// the offending argument.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "ops/common/arg_checks.h"

namespace pagellm::int8 {

struct Int8LinearShape {
  int64_t M, N, K;
  bool has_bias;
};

// out [M, N] (x's dtype, last dim contiguous) = x [M, K] @ (weight [N, K] int8 * weight_scale [N] fp32)^T + bias [N].
inline Int8LinearShape check_int8_linear_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                                              const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                                              double threshold, bool zero_point, int64_t group_size) {
  check_float(x, "x");
  check_same_dtype(out, x, "out", "x");
  check_dtype(weight, at::kChar, "weight");
  check_dtype(weight_scale, at::kFloat, "weight_scale");
  check_dim(x, 2, "x");
  check_dim(weight, 2, "weight");
  check_dim(out, 2, "out");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight must have shape [N, ", K, "] (K of x), got ", weight.sizes());
  TORCH_CHECK(K < (int64_t{1} << 17), "x: K = ", K, " is too large for int32 accumulation (must be < 131072)");
  TORCH_CHECK(!zero_point || K < (int64_t{1} << 16), "x: K = ", K,
              " is too large for int32 accumulation of zero-point rows (must be < 65536)");
  TORCH_CHECK(weight_scale.dim() == 1 && weight_scale.size(0) == N, "weight_scale must have shape [", N, "], got ",
              weight_scale.sizes());
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must have shape [", M, ", ", N, "], got ", out.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check_same_dtype(*bias, x, "bias", "x");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must have shape [", N, "], got ", bias->sizes());
  }
  TORCH_CHECK(group_size == 0 || (group_size > 0 && group_size % 64 == 0), "group_size must be 0 (one activation "
              "scale per row) or a positive multiple of 64, got ", group_size);
  TORCH_CHECK(group_size == 0 || !zero_point, "group_size > 0 takes absmax groups: zero_point must be false");
  TORCH_CHECK(threshold >= 0.0, "threshold must be >= 0 (0 = no outlier columns), got ", threshold);
  check_last_contiguous(out, "out");
  return {M, N, K, has_bias};
}

}  // namespace pagellm::int8
