// CUDA glue for paged_mla_decode (kernel: mla_decode_kernels.cu, the paged decode kernel at 576 / 512).
// Checks mirror the CPU glue except those that would read device data (seq_lens, block-table values): the
// kernel bounds every block-table read and skips out-of-range blocks instead.
#include <torch/library.h>

#include <cstdint>

#include "ops/cuda_common/torch_glue.h"
#include "ops/paged_attention/attention_launch.h"
#include "ops/paged_attention/mla_checks.h"
#include "ops/paged_attention/split_counters_cuda.h"

namespace pagellm::cuda {
namespace {

void paged_mla_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& latent_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  check_cuda(out, "out");
  check_cuda(query, "query");
  check_cuda(latent_cache, "latent_cache");
  check_cuda(block_tables, "block_tables");
  check_cuda(seq_lens, "seq_lens");
  check_same_device(out, query, "out", "query");
  check_same_device(latent_cache, query, "latent_cache", "query");
  check_same_device(block_tables, query, "block_tables", "query");
  check_same_device(seq_lens, query, "seq_lens", "query");
  const DType dt = to_dtype(query, "query");
  const MlaDecodeShape s = check_paged_mla_decode(out, query, latent_cache, block_tables, seq_lens);
  TORCH_CHECK(s.latent_dim == kMlaLatentDim && s.kv_lora_rank == kMlaKvLoraRank,
              "paged_mla_decode on CUDA needs latent_dim ", kMlaLatentDim, " and kv_lora_rank (out's last dim) ",
              kMlaKvLoraRank, " (DeepSeek-V2/V3), got ", s.latent_dim, " and ", s.kv_lora_rank);
  TORCH_CHECK(s.num_heads <= 65535 && s.num_seqs <= INT32_MAX, "too many heads or sequences");
  if (s.num_seqs == 0 || s.num_heads == 0) return;
  const c10::cuda::CUDAGuard guard(query.device());
  TORCH_CHECK(aligned16(latent_cache), "latent_cache must be 16-byte aligned");
  const at::Tensor lens = seq_lens.contiguous();
  DecodeArgs a{};
  a.out = out.data_ptr();
  a.query = query.data_ptr();
  a.key_cache = latent_cache.data_ptr();
  a.value_cache = latent_cache.data_ptr();  // value = the first kv_lora_rank dims of the same rows
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.seq_lens = lens.data_ptr<int32_t>();
  a.q_stride_tok = query.stride(0);
  a.q_stride_head = query.stride(1);
  a.o_stride_tok = out.stride(0);
  a.o_stride_head = out.stride(1);
  a.bt_stride = block_tables.stride(0);
  a.num_seqs = static_cast<int>(s.num_seqs);
  a.num_heads = static_cast<int>(s.num_heads);
  a.num_kv_heads = 1;
  a.head_dim = kMlaLatentDim;
  a.v_head_dim = kMlaKvLoraRank;
  a.block_size = static_cast<int>(s.block_size);
  a.max_blocks = static_cast<int>(block_tables.size(1));
  a.num_blocks = s.num_blocks;
  a.window = -1;
  a.scale = static_cast<float>(scale);
  a.softcap = 0.f;
  const int64_t max_context = block_tables.size(1) * s.block_size;  // sync-free upper bound of every seq_len
  a.num_splits = decode_num_splits(a.num_seqs, a.num_heads, 1, max_context, -1);
  const bool merge_in_kernel = decode_merge_in_kernel();
  at::Tensor tmp_out, tmp_ms;
  if (a.num_splits > 1) {
    const auto f32 = query.options().dtype(at::kFloat);
    tmp_out = at::empty({s.num_seqs, s.num_heads, a.num_splits, s.kv_lora_rank}, f32);
    tmp_ms = at::empty({2, s.num_seqs, s.num_heads, a.num_splits}, f32);
    a.tmp_out = tmp_out.data_ptr<float>();
    a.tmp_max = tmp_ms.data_ptr<float>();
    a.tmp_sum = a.tmp_max + s.num_seqs * s.num_heads * a.num_splits;
    if (merge_in_kernel)
      a.split_counters = decode_split_counters(query, decode_split_counter_count(a.num_seqs, a.num_heads, 1));
  }
  check_launch(launch_paged_mla_decode(a, dt, current_stream()), "paged_mla_decode");
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) { m.impl("paged_mla_decode", &pagellm::cuda::paged_mla_decode); }
