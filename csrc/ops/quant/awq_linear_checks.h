// Device-independent argument checks of awq_linear, shared by the CPU and CUDA glue. Every failure names the
// offending argument (and the shape it must have). Zero points are not checked per element (0..15 by contract).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "ops/common/arg_checks.h"
#include "ops/quant/awq_layout.h"

namespace pagellm::awq {

struct AwqLinearInputs {
  at::Tensor x, bias;  // x with a contiguous last dim; bias contiguous or undefined
  int64_t M, N, K, group_size;
};

// out [M, N] (x's dtype, last dim contiguous) = x [M, K] @ W^T + bias [N], W from qweight uint8 [N, K / 2],
// scales float32 [N, K / G], zeros uint8 [N, K / G] (awq_layout.h); all three contiguous.
inline AwqLinearInputs check_awq_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                                        const at::Tensor& scales, const at::Tensor& zeros, int64_t group_size,
                                        const std::optional<at::Tensor>& bias) {
  check_float(x, "x");
  check_same_dtype(out, x, "out", "x");
  check_dtype(qweight, at::kByte, "qweight");
  check_dtype(scales, at::kFloat, "scales");
  check_dtype(zeros, at::kByte, "zeros");
  check_dim(x, 2, "x");
  check_dim(qweight, 2, "qweight");
  check_dim(scales, 2, "scales");
  check_dim(zeros, 2, "zeros");
  check_dim(out, 2, "out");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(group_size > 0 && group_size % kBlockElems == 0,
              "group_size must be a positive multiple of 32 (32, 64, 128, ...), got ", group_size);
  TORCH_CHECK(K > 0 && K % kBlockElems == 0, "x: K = ", K, " (in_features) must be a positive multiple of 32");
  TORCH_CHECK(K % group_size == 0, "group_size (", group_size, ") must divide K = ", K, " (in_features)");
  TORCH_CHECK(qweight.size(1) == K / 2, "qweight must have shape [N, K / 2 = ", K / 2,
              "] (two 4-bit weights per byte), got ", qweight.sizes());
  const int64_t num_groups = K / group_size;
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == num_groups, "scales must have shape [N, K / group_size] = [",
              N, ", ", num_groups, "], got ", scales.sizes());
  TORCH_CHECK(zeros.size(0) == N && zeros.size(1) == num_groups, "zeros must have shape [N, K / group_size] = [",
              N, ", ", num_groups, "], got ", zeros.sizes());
  check_contiguous(qweight, "qweight");
  check_contiguous(scales, "scales");
  check_contiguous(zeros, "zeros");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must have shape [", M, ", ", N, "], got ", out.sizes());
  check_last_contiguous(out, "out");
  AwqLinearInputs in{x.stride(1) == 1 ? x : x.contiguous(), at::Tensor(), M, N, K, group_size};
  if (bias.has_value() && bias->defined()) {
    check_same_dtype(*bias, x, "bias", "x");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must have shape [", N, "], got ", bias->sizes());
    in.bias = bias->contiguous();
  }
  return in;
}

}  // namespace pagellm::awq
