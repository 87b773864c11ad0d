// Device-independent checks of the paged-attention arguments, shared by the CPU and the CUDA glue; each
// glue adds its own device checks and the head dims its kernels support.
#pragma once

#include <ATen/ATen.h>

#include "ops/cache_ops/kv_quant_checks.h"
#include "ops/common/arg_checks.h"

namespace pagellm {

struct PagedAttentionShape {
  int64_t num_blocks, num_kv_heads, block_size, head_dim, num_heads;
};

// k_scale / v_scale: null for a float cache (of the query's dtype); given for a quantized one (int8 / fp8 values).
inline PagedAttentionShape check_paged_attention_shapes(const at::Tensor& out, const at::Tensor& query,
                                                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                        const at::Tensor* k_scale = nullptr,
                                                        const at::Tensor* v_scale = nullptr) {
  check_same_dtype(out, query, "out", "query");
  if (k_scale != nullptr) {
    check_quantized_kv_cache(key_cache, value_cache, *k_scale, *v_scale);
  } else {
    check_same_dtype(key_cache, query, "key_cache", "query");
    check_same_dtype(value_cache, query, "value_cache", "query");
  }
  check_dim(query, 3, "query");
  check_dim(key_cache, 4, "key_cache");
  check_contiguous(key_cache, "key_cache");
  check_contiguous(value_cache, "value_cache");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "value_cache shape ", value_cache.sizes(),
              " must equal key_cache shape ", key_cache.sizes());
  TORCH_CHECK(out.sizes() == query.sizes(), "out shape ", out.sizes(), " must equal query shape ", query.sizes());
  check_last_contiguous(query, "query");
  check_last_contiguous(out, "out");
  check_dtype(block_tables, at::kInt, "block_tables");
  check_dim(block_tables, 2, "block_tables");
  check_dtype(seq_lens, at::kInt, "seq_lens");
  check_dim(seq_lens, 1, "seq_lens");
  const PagedAttentionShape s{key_cache.size(0), key_cache.size(1), key_cache.size(2), key_cache.size(3),
                              query.size(1)};
  TORCH_CHECK(s.block_size >= 1 && s.block_size <= 256 && (s.block_size & (s.block_size - 1)) == 0,
              "key_cache: block_size (dim 2) must be a power of two in [1, 256], got ", s.block_size);
  TORCH_CHECK(query.size(2) == s.head_dim, "query head_dim ", query.size(2), " must equal key_cache head_dim ",
              s.head_dim);
  TORCH_CHECK(s.num_kv_heads > 0 && s.num_heads % s.num_kv_heads == 0, "query num_heads ", s.num_heads,
              " must be a multiple of key_cache num_kv_heads ", s.num_kv_heads);
  TORCH_CHECK(block_tables.size(0) == seq_lens.size(0), "block_tables must have one row per sequence (",
              seq_lens.size(0), " from seq_lens), got shape ", block_tables.sizes());
  TORCH_CHECK(block_tables.stride(1) == 1 || block_tables.size(1) <= 1, "block_tables must be row-contiguous");
  return s;
}

}  // namespace pagellm
