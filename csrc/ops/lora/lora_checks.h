// Device-independent checks of lora_apply's arguments, shared by the CPU and CUDA glue.
#pragma once

#include <ATen/ATen.h>

#include "ops/common/arg_checks.h"

namespace pagellm {

// y [T, N], x [T, K] (rows may be strided, last dim contiguous); lora_a [S, R, K], lora_b [S, N, R] contiguous in x's
// dtype; scales float32 [S]; token_slots int32 [T]. Slot values are checked by the kernels' callers (CPU) or
// ignored when out of range (CUDA cannot throw from a kernel; the Python wrapper checks them).
inline void check_lora_apply_args(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                                  const at::Tensor& lora_b, const at::Tensor& scales, const at::Tensor& token_slots) {
  check_float(x, "x");
  check_same_dtype(y, x, "y", "x");
  check_same_dtype(lora_a, x, "lora_a", "x");
  check_same_dtype(lora_b, x, "lora_b", "x");
  check_dtype(scales, at::kFloat, "scales");
  check_dtype(token_slots, at::kInt, "token_slots");
  check_dim(y, 2, "y");
  check_dim(x, 2, "x");
  check_dim(lora_a, 3, "lora_a");
  check_dim(lora_b, 3, "lora_b");
  check_dim(scales, 1, "scales");
  check_dim(token_slots, 1, "token_slots");
  const int64_t T = x.size(0), K = x.size(1), S = lora_a.size(0), R = lora_a.size(1), N = y.size(1);
  TORCH_CHECK(y.size(0) == T, "y must have shape [T = ", T, ", N], got ", y.sizes());
  TORCH_CHECK(lora_a.size(2) == K, "lora_a must have shape [S, R, K = ", K, "], got ", lora_a.sizes());
  TORCH_CHECK(lora_b.size(0) == S && lora_b.size(1) == N && lora_b.size(2) == R,
              "lora_b must have shape [S = ", S, ", N = ", N, ", R = ", R, "], got ", lora_b.sizes());
  TORCH_CHECK(scales.size(0) == S, "scales must have shape [S = ", S, "], got ", scales.sizes());
  TORCH_CHECK(token_slots.size(0) == T, "token_slots must have shape [T = ", T, "], got ", token_slots.sizes());
  check_last_contiguous(y, "y");
  check_last_contiguous(x, "x");
  check_contiguous(lora_a, "lora_a");
  check_contiguous(lora_b, "lora_b");
  check_contiguous(scales, "scales");
  check_contiguous(token_slots, "token_slots");
}

}  // namespace pagellm
