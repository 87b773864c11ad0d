// CPU glue for paged_tree_attention (float caches): validation of shapes, dtypes, the query_start_loc values, the
// tree mask's width and every block-table entry a sequence reads, then tree_attention_cpu_kernels.h.
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/paged_attention/attention_checks.h"
#include "ops/tree_attention/tree_attention_checks.h"
#include "ops/tree_attention/tree_attention_cpu_kernels.h"

namespace pagellm::cpu {
namespace {

// 0 <= q_len <= seq_len <= capacity per sequence, and every block id the sequence reads in [0, num_blocks).
void check_sequences(const at::Tensor& block_tables, const int32_t* lens, const int32_t* qsl, int64_t num_tokens,
                     int64_t mask_width, const PagedAttentionShape& c) {
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t S = block_tables.size(0), max_blocks = block_tables.size(1), stride = block_tables.stride(0);
  TORCH_CHECK(qsl[0] >= 0 && qsl[S] <= num_tokens, "query_start_loc must lie in [0, num_tokens = ", num_tokens,
              "], got first ", qsl[0], " last ", qsl[S]);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(q_len >= 0, "query_start_loc must be non-decreasing, got [", s, "] = ", qsl[s], " > [", s + 1,
                "] = ", qsl[s + 1]);
    TORCH_CHECK(q_len <= mask_width, "tree_mask has ", mask_width, " columns, fewer than sequence ", s, "'s ", q_len,
                " tree tokens");
    TORCH_CHECK(q_len <= lens[s] && lens[s] <= max_blocks * c.block_size, "seq_lens[", s, "] = ", lens[s],
                " must lie in [tree tokens = ", q_len, ", block_tables width x block_size = ",
                max_blocks * c.block_size, "]");
    for (int64_t b = 0; b < (lens[s] + c.block_size - 1) / c.block_size; ++b) {
      const int32_t id = bt[s * stride + b];
      TORCH_CHECK(id >= 0 && id < c.num_blocks, "block_tables[", s, "][", b, "] = ", id, " is out of range [0, ",
                  c.num_blocks, ")");
    }
  }
}

template <typename T>
PagedAttnArgs<T> make_args(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables, const int32_t* lens,
                           const int32_t* qsl, const PagedAttentionShape& c, double scale, double softcap) {
  int64_t log2_bs = 0;
  while ((int64_t{1} << log2_bs) < c.block_size) ++log2_bs;
  return PagedAttnArgs<T>{out.data_ptr<T>(), query.data_ptr<T>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
                          block_tables.data_ptr<int32_t>(), lens, qsl, block_tables.stride(0), block_tables.size(0),
                          c.num_heads, c.num_kv_heads, c.head_dim, c.block_size, log2_bs, query.stride(0),
                          query.stride(1), out.stride(0), out.stride(1), key_cache.stride(0), key_cache.stride(1),
                          static_cast<float>(scale), /*window=*/-1, static_cast<float>(softcap)};
}

void paged_tree_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& tree_mask,
                          double scale, double softcap) {
  using Named = std::pair<const at::Tensor*, const char*>;
  for (const auto& [t, name] : {Named{&out, "out"}, {&query, "query"}, {&key_cache, "key_cache"},
                                {&value_cache, "value_cache"}, {&block_tables, "block_tables"},
                                {&query_start_loc, "query_start_loc"}, {&seq_lens, "seq_lens"},
                                {&tree_mask, "tree_mask"}})
    check_cpu(*t, name);
  check_float(query, "query");
  const PagedAttentionShape c = check_paged_attention_shapes(out, query, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(c.head_dim % 16 == 0 && c.head_dim >= 16 && c.head_dim <= 512,
              "key_cache: head_dim (dim 3) must be a multiple of 16 in [16, 512], got ", c.head_dim);
  check_tree_attention_args(query, query_start_loc, seq_lens, tree_mask, softcap);
  const at::Tensor lens = seq_lens.contiguous(), qsl = query_start_loc.contiguous();
  const at::Tensor mask = tree_mask.contiguous();
  check_sequences(block_tables, lens.data_ptr<int32_t>(), qsl.data_ptr<int32_t>(), query.size(0), mask.size(1), c);
  if (seq_lens.size(0) == 0 || query.size(0) == 0) return;
  const TreeMask tm{static_cast<const uint8_t*>(mask.data_ptr()), mask.size(1)};
  PAGELLM_DISPATCH_FLOAT_TYPES(query.scalar_type(), "paged_tree_attention", [&] {
    paged_tree_attention_kernel(make_args<scalar_t>(out, query, key_cache, value_cache, block_tables,
                                                    lens.data_ptr<int32_t>(), qsl.data_ptr<int32_t>(), c, scale,
                                                    softcap),
                                tm);
  });
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("paged_tree_attention", &pagellm::cpu::paged_tree_attention); }
