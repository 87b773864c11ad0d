// fused_moe argument checks shared by the CPU and CUDA glue (device checks and the id range stay with
// each glue: the CPU reads the ids, the GPU kernels skip ids outside [0, E)). Every failure names the argument.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "ops/common/arg_checks.h"
#include "ops/moe/moe_activation.h"

namespace pagellm::moe {

// Sizes of one call: T tokens of width H, E experts of intermediate size I, k experts per token.
struct MoeShape {
  int64_t T, H, E, I, k;
};

inline MoeActivation parse_moe_activation(const std::string& activation) {
  if (activation == "silu") return MoeActivation::kSilu;
  if (activation == "gelu_tanh") return MoeActivation::kGeluTanh;
  TORCH_CHECK(false, "fused_moe: activation must be \"silu\" or \"gelu_tanh\", got \"", activation, "\"");
  return MoeActivation::kSilu;  // unreachable
}

// hidden [T, H]; w13 [E, 2I, H] and w2 [E, H, I] in hidden's dtype; topk_weights float32 [T, k];
// topk_ids int32 [T, k]. Contiguity is the glue's business (it copies what is not).
inline MoeShape check_fused_moe(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                                const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  check_float(hidden, "hidden");
  check_same_dtype(w13, hidden, "w13", "hidden");
  check_same_dtype(w2, hidden, "w2", "hidden");
  check_dtype(topk_weights, at::kFloat, "topk_weights");
  check_dtype(topk_ids, at::kInt, "topk_ids");
  check_dim(hidden, 2, "hidden");
  check_dim(w13, 3, "w13");
  check_dim(w2, 3, "w2");
  check_dim(topk_weights, 2, "topk_weights");
  check_dim(topk_ids, 2, "topk_ids");
  const MoeShape s{hidden.size(0), hidden.size(1), w13.size(0), w13.size(1) / 2, topk_ids.size(1)};
  TORCH_CHECK(w13.size(1) % 2 == 0 && w13.size(2) == s.H, "w13 must have shape [E, 2 * I, H = ", s.H, "], got ",
              w13.sizes());
  TORCH_CHECK(w2.size(0) == s.E && w2.size(1) == s.H && w2.size(2) == s.I, "w2 must have shape [E = ", s.E,
              ", H = ", s.H, ", I = ", s.I, "] (from w13 ", w13.sizes(), "), got ", w2.sizes());
  TORCH_CHECK(topk_ids.size(0) == s.T, "topk_ids must have shape [T = ", s.T, ", k], got ", topk_ids.sizes());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights must have the shape of topk_ids (",
              topk_ids.sizes(), "), got ", topk_weights.sizes());
  TORCH_CHECK(s.k <= s.E, "topk_ids chooses k = ", s.k, " experts per token out of only E = ", s.E);
  return s;
}

}  // namespace pagellm::moe
