// Device-independent checks of paged_mla_decode's arguments (shared by the CPU and the CUDA glue; each adds its
// device checks and the widths its kernel supports). Every failure names the argument.
#pragma once

#include <ATen/ATen.h>

#include "ops/common/arg_checks.h"

namespace pagellm {

// out [num_seqs, num_heads, kv_lora_rank]; query [num_seqs, num_heads, latent_dim];
// latent_cache [num_blocks, block_size, latent_dim], contiguous.
struct MlaDecodeShape {
  int64_t num_seqs, num_heads, latent_dim, kv_lora_rank, num_blocks, block_size;
};

inline MlaDecodeShape check_paged_mla_decode(const at::Tensor& out, const at::Tensor& query,
                                             const at::Tensor& latent_cache, const at::Tensor& block_tables,
                                             const at::Tensor& seq_lens) {
  check_float(query, "query");
  check_same_dtype(out, query, "out", "query");
  check_same_dtype(latent_cache, query, "latent_cache", "query");
  check_dim(query, 3, "query");
  check_dim(out, 3, "out");
  check_dim(latent_cache, 3, "latent_cache");
  check_contiguous(latent_cache, "latent_cache");
  check_last_contiguous(query, "query");
  check_last_contiguous(out, "out");
  check_dtype(block_tables, at::kInt, "block_tables");
  check_dim(block_tables, 2, "block_tables");
  check_dtype(seq_lens, at::kInt, "seq_lens");
  check_dim(seq_lens, 1, "seq_lens");
  const MlaDecodeShape s{query.size(0), query.size(1), latent_cache.size(2), out.size(2), latent_cache.size(0),
                         latent_cache.size(1)};
  TORCH_CHECK(query.size(2) == s.latent_dim, "query's last dim ", query.size(2), " must equal latent_cache's ",
              s.latent_dim);
  TORCH_CHECK(out.size(0) == s.num_seqs && out.size(1) == s.num_heads && s.kv_lora_rank >= 1 &&
                  s.kv_lora_rank <= s.latent_dim,
              "out must have shape [", s.num_seqs, ", ", s.num_heads, ", kv_lora_rank in [1, ", s.latent_dim,
              "]], got ", out.sizes());
  TORCH_CHECK(s.block_size >= 1 && s.block_size <= 256 && (s.block_size & (s.block_size - 1)) == 0,
              "latent_cache: block_size (dim 1) must be a power of two in [1, 256], got ", s.block_size);
  TORCH_CHECK(seq_lens.size(0) == s.num_seqs, "seq_lens must have one entry per query token (", s.num_seqs,
              "), got shape ", seq_lens.sizes());
  TORCH_CHECK(block_tables.size(0) == s.num_seqs, "block_tables must have one row per sequence (", s.num_seqs,
              "), got shape ", block_tables.sizes());
  TORCH_CHECK(block_tables.stride(1) == 1 || block_tables.size(1) <= 1, "block_tables must be row-contiguous");
  return s;
}

}  // namespace pagellm
