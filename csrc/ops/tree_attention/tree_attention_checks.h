// Device-independent checks of paged_tree_attention's extra arguments (query_start_loc, tree_mask), shared by the
// CPU and CUDA glue; the paged-cache arguments are checked by check_paged_attention_shapes.
#pragma once

#include <ATen/ATen.h>

#include "ops/common/arg_checks.h"

namespace pagellm {

// query_start_loc int32 [num_seqs + 1]; tree_mask bool / uint8 [num_tokens, max_tree_tokens].
inline void check_tree_attention_args(const at::Tensor& query, const at::Tensor& query_start_loc,
                                      const at::Tensor& seq_lens, const at::Tensor& tree_mask, double softcap) {
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0 = off), got ", softcap);
  check_dtype(query_start_loc, at::kInt, "query_start_loc");
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == S + 1,
              "query_start_loc must have shape [num_seqs + 1] = [", S + 1, "], got ", query_start_loc.sizes());
  TORCH_CHECK(tree_mask.scalar_type() == at::kBool || tree_mask.scalar_type() == at::kByte,
              "tree_mask must be bool or uint8, got ", tree_mask.scalar_type());
  TORCH_CHECK(tree_mask.dim() == 2 && tree_mask.size(0) == query.size(0),
              "tree_mask must have shape [num_tokens = ", query.size(0), ", max_tree_tokens], got ", tree_mask.sizes());
}

}  // namespace pagellm
