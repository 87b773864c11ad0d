// CUDA glue for paged_tree_attention (float caches; kernel in tree_attention_kernels.cu). Checks mirror the CPU
// glue except those that would read device data (seq_lens, block tables, query_start_loc values): the kernel
// bounds every block-table read and mask column instead.
#include <torch/library.h>

#include <cstdint>
#include <utility>

#include "ops/cuda_common/torch_glue.h"
#include "ops/paged_attention/attention_checks.h"
#include "ops/tree_attention/tree_attention_checks.h"
#include "ops/tree_attention/tree_attention_launch.h"

namespace pagellm::cuda {
namespace {

void paged_tree_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& tree_mask,
                          double scale, double softcap) {
  using Named = std::pair<const at::Tensor*, const char*>;
  for (const auto& [t, name] :
       {Named{&out, "out"}, {&query, "query"}, {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
        {&block_tables, "block_tables"}, {&query_start_loc, "query_start_loc"}, {&seq_lens, "seq_lens"},
        {&tree_mask, "tree_mask"}}) {
    check_cuda(*t, name);
    check_same_device(*t, query, name, "query");
  }
  const DType dtype = to_dtype(query, "query");
  const PagedAttentionShape c = check_paged_attention_shapes(out, query, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(tree_attention_head_dim_supported(static_cast<int>(c.head_dim)),
              "key_cache: head_dim (dim 3) must be one of 64, 80, 96, 112, 128, 256 on CUDA, got ", c.head_dim);
  TORCH_CHECK(c.num_heads <= 65535 * 4, "query num_heads must be <= 262140, got ", c.num_heads);
  check_tree_attention_args(query, query_start_loc, seq_lens, tree_mask, softcap);
  const int64_t S = seq_lens.size(0), T = query.size(0);
  TORCH_CHECK(T <= INT32_MAX && S <= INT32_MAX, "too many query tokens or sequences");
  if (S == 0 || T == 0 || c.num_heads == 0) return;
  const c10::cuda::CUDAGuard guard(query.device());
  const at::Tensor lens = seq_lens.contiguous(), qsl = query_start_loc.contiguous();
  const at::Tensor mask = tree_mask.contiguous();
  TreeAttentionArgs a{};
  a.out = out.data_ptr();
  a.query = query.data_ptr();
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.query_start_loc = qsl.data_ptr<int32_t>();
  a.seq_lens = lens.data_ptr<int32_t>();
  a.tree_mask = static_cast<const uint8_t*>(mask.data_ptr());
  a.q_stride_tok = query.stride(0);
  a.q_stride_head = query.stride(1);
  a.o_stride_tok = out.stride(0);
  a.o_stride_head = out.stride(1);
  a.bt_stride = block_tables.stride(0);
  a.mask_stride = mask.size(1);
  a.num_seqs = static_cast<int>(S);
  a.num_tokens = static_cast<int>(T);
  a.num_heads = static_cast<int>(c.num_heads);
  a.num_kv_heads = static_cast<int>(c.num_kv_heads);
  a.head_dim = static_cast<int>(c.head_dim);
  a.block_size = static_cast<int>(c.block_size);
  a.max_blocks = static_cast<int>(block_tables.size(1));
  a.num_blocks = c.num_blocks;
  a.scale = static_cast<float>(scale);
  a.softcap = static_cast<float>(softcap);
  check_launch(launch_paged_tree_attention(a, dtype, current_stream()), "paged_tree_attention");
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) { m.impl("paged_tree_attention", &pagellm::cuda::paged_tree_attention); }
