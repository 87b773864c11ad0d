// CUDA glue for paged_attention_decode / paged_attention_prefill and their *_quantized forms over int8 / fp8 caches
// (kernels in decode_kernels.cu, prefill_kernels.cu and the *_quant_kernels.cu).
// Checks mirror the CPU glue except those that would read device data (seq_lens, block tables, query_start_loc
// values): the kernels bound every block-table read and zero-fill / skip what is out of range instead.
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>

#include "ops/cuda_common/torch_glue.h"
#include "ops/paged_attention/attention_checks.h"
#include "ops/paged_attention/attention_launch.h"
#include "ops/paged_attention/split_counters_cuda.h"

namespace pagellm::cuda {
namespace {

// PAGELLM_CUDA_DECODE_SPLIT_GRAIN: the fewest tokens of a flash-decoding split (DecodeArgs::split_grain), for a
// benchmark sweep; unset = the kernel's default (64). Read at every call, so a CUDA graph captured after the
// variable changed uses the new value. A row's bits depend on it (never on the batch).
int decode_split_grain() {
  const char* env = std::getenv("PAGELLM_CUDA_DECODE_SPLIT_GRAIN");
  if (env == nullptr || *env == '\0') return 0;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  TORCH_CHECK(*end == '\0' && v >= 16 && v <= 65536,
              "PAGELLM_CUDA_DECODE_SPLIT_GRAIN must be an integer in [16, 65536], got '", env, "'");
  return static_cast<int>(v);
}

struct Common : PagedAttentionShape {
  DType dtype;
};

// A quantized cache's k_scale / v_scale; both null for a float cache.
struct Scales {
  const at::Tensor* k = nullptr;
  const at::Tensor* v = nullptr;
};

Common check_common(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    Scales scales = {}) {
  check_cuda(out, "out");
  check_cuda(query, "query");
  check_cuda(key_cache, "key_cache");
  check_cuda(value_cache, "value_cache");
  check_cuda(block_tables, "block_tables");
  check_cuda(seq_lens, "seq_lens");
  check_same_device(out, query, "out", "query");
  check_same_device(key_cache, query, "key_cache", "query");
  check_same_device(value_cache, query, "value_cache", "query");
  check_same_device(block_tables, query, "block_tables", "query");
  check_same_device(seq_lens, query, "seq_lens", "query");
  const DType dt = to_dtype(query, "query");
  const Common c{
      check_paged_attention_shapes(out, query, key_cache, value_cache, block_tables, seq_lens, scales.k, scales.v),
      dt};  // (the scales' device is checked against key_cache there)
  TORCH_CHECK(attention_head_dim_supported(static_cast<int>(c.head_dim)),
              "key_cache: head_dim (dim 3) must be one of 64, 80, 96, 112, 128, 256 on CUDA, got ", c.head_dim);
  TORCH_CHECK(c.num_heads <= 65535, "query num_heads must be <= 65535, got ", c.num_heads);
  TORCH_CHECK(seq_lens.size(0) <= INT32_MAX, "too many sequences");
  return c;
}

void check_scalars(int64_t window_size, double softcap) {
  TORCH_CHECK(window_size == -1 || window_size > 0, "window_size must be -1 (full) or positive, got ", window_size);
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0 = off), got ", softcap);
}

int clamp_window(int64_t window_size) {
  return window_size <= 0 ? -1 : static_cast<int>(window_size > INT32_MAX ? INT32_MAX : window_size);
}

KvCacheDType kv_cache_dtype(const at::Tensor& key_cache) {
  return key_cache.scalar_type() == at::kChar ? KvCacheDType::kInt8 : KvCacheDType::kFp8E4M3;
}

void run_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window_size,
                double softcap, Scales scales) {
  const Common c = check_common(out, query, key_cache, value_cache, block_tables, seq_lens, scales);
  check_scalars(window_size, softcap);
  TORCH_CHECK(query.size(0) == seq_lens.size(0), "query must have one token per sequence (", seq_lens.size(0),
              " from seq_lens), got shape ", query.sizes());
  const int64_t S = query.size(0);
  if (S == 0 || c.num_heads == 0) return;
  const c10::cuda::CUDAGuard guard(query.device());
  const at::Tensor lens = seq_lens.contiguous();
  const int window = clamp_window(window_size);
  const int64_t max_context = block_tables.size(1) * c.block_size;  // sync-free upper bound of every seq_len
  DecodeArgs a{};
  a.out = out.data_ptr();
  a.query = query.data_ptr();
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.seq_lens = lens.data_ptr<int32_t>();
  a.q_stride_tok = query.stride(0);
  a.q_stride_head = query.stride(1);
  a.o_stride_tok = out.stride(0);
  a.o_stride_head = out.stride(1);
  a.bt_stride = block_tables.stride(0);
  a.num_seqs = static_cast<int>(S);
  a.num_heads = static_cast<int>(c.num_heads);
  a.num_kv_heads = static_cast<int>(c.num_kv_heads);
  a.head_dim = static_cast<int>(c.head_dim);
  a.block_size = static_cast<int>(c.block_size);
  a.max_blocks = static_cast<int>(block_tables.size(1));
  a.num_blocks = c.num_blocks;
  a.window = window;
  a.scale = static_cast<float>(scale);
  a.softcap = static_cast<float>(softcap);
  TORCH_CHECK(aligned16(key_cache) && aligned16(value_cache), "key_cache / value_cache must be 16-byte aligned");
  a.split_grain = decode_split_grain();
  const bool merge_in_kernel = decode_merge_in_kernel();
  a.num_splits = decode_num_splits(a.num_seqs, a.num_heads, a.num_kv_heads, max_context, window, a.split_grain);
  at::Tensor tmp_out, tmp_ms;
  if (a.num_splits > 1) {
    const auto f32 = query.options().dtype(at::kFloat);
    tmp_out = at::empty({S, c.num_heads, a.num_splits, c.head_dim}, f32);
    tmp_ms = at::empty({2, S, c.num_heads, a.num_splits}, f32);
    a.tmp_out = tmp_out.data_ptr<float>();
    a.tmp_max = tmp_ms.data_ptr<float>();
    a.tmp_sum = a.tmp_max + S * c.num_heads * a.num_splits;
    if (merge_in_kernel)
      a.split_counters = decode_split_counters(query, decode_split_counter_count(a.num_seqs, a.num_heads,
                                                                                 a.num_kv_heads));
  }
  if (scales.k == nullptr) {
    check_launch(launch_paged_attention_decode(a, c.dtype, current_stream()), "paged_attention_decode");
    return;
  }
  a.k_scale = scales.k->data_ptr<float>();
  a.v_scale = scales.v->data_ptr<float>();
  check_launch(launch_paged_attention_decode_quantized(a, c.dtype, kv_cache_dtype(key_cache), current_stream()),
               "paged_attention_decode_quantized");
}

void paged_attention_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, int64_t window_size, double softcap) {
  run_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, window_size, softcap, {});
}

void paged_attention_decode_quantized(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, const at::Tensor& k_scale,
                                      const at::Tensor& v_scale, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, double scale, int64_t window_size, double softcap) {
  run_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, window_size, softcap,
             {&k_scale, &v_scale});
}

void run_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                 const at::Tensor& seq_lens, double scale, int64_t window_size, double softcap, Scales scales) {
  const Common c = check_common(out, query, key_cache, value_cache, block_tables, seq_lens, scales);
  check_scalars(window_size, softcap);
  check_cuda(query_start_loc, "query_start_loc");
  check_same_device(query_start_loc, query, "query_start_loc", "query");
  check_dtype(query_start_loc, at::kInt, "query_start_loc");
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == S + 1,
              "query_start_loc must have shape [num_seqs + 1] = [", S + 1, "], got ", query_start_loc.sizes());
  const int64_t T = query.size(0);
  TORCH_CHECK(T <= INT32_MAX, "too many query tokens: ", T);
  if (S == 0 || T == 0 || c.num_heads == 0) return;
  const c10::cuda::CUDAGuard guard(query.device());
  const at::Tensor lens = seq_lens.contiguous();
  const at::Tensor qsl = query_start_loc.contiguous();
  // The tensor-core kernel moves query/out rows as 16-byte vectors: use aligned copies when the views are not.
  const bool tc = c.dtype != DType::kFloat32;
  auto vec_ok = [](const at::Tensor& t) { return aligned16(t) && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0; };
  const at::Tensor q = (!tc || vec_ok(query)) ? query : query.clone(at::MemoryFormat::Contiguous);
  at::Tensor o = (!tc || vec_ok(out)) ? out : out.clone(at::MemoryFormat::Contiguous);  // keeps rows no seq covers
  TORCH_CHECK(!tc || (vec_ok(q) && vec_ok(o)), "query/out could not be made 16-byte aligned");
  TORCH_CHECK(aligned16(key_cache) && aligned16(value_cache), "key_cache / value_cache must be 16-byte aligned");
  PrefillArgs a{};
  a.out = o.data_ptr();
  a.query = q.data_ptr();
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.query_start_loc = qsl.data_ptr<int32_t>();
  a.seq_lens = lens.data_ptr<int32_t>();
  a.q_stride_tok = q.stride(0);
  a.q_stride_head = q.stride(1);
  a.o_stride_tok = o.stride(0);
  a.o_stride_head = o.stride(1);
  a.bt_stride = block_tables.stride(0);
  a.num_seqs = static_cast<int>(S);
  a.num_tokens = static_cast<int>(T);
  a.num_heads = static_cast<int>(c.num_heads);
  a.num_kv_heads = static_cast<int>(c.num_kv_heads);
  a.head_dim = static_cast<int>(c.head_dim);
  a.block_size = static_cast<int>(c.block_size);
  a.max_blocks = static_cast<int>(block_tables.size(1));
  a.num_blocks = c.num_blocks;
  a.window = clamp_window(window_size);
  a.scale = static_cast<float>(scale);
  a.softcap = static_cast<float>(softcap);
  if (scales.k == nullptr) {
    check_launch(launch_paged_attention_prefill(a, c.dtype, current_stream()), "paged_attention_prefill");
  } else {
    a.k_scale = scales.k->data_ptr<float>();
    a.v_scale = scales.v->data_ptr<float>();
    check_launch(launch_paged_attention_prefill_quantized(a, c.dtype, kv_cache_dtype(key_cache), current_stream()),
                 "paged_attention_prefill_quantized");
  }
  if (!o.is_same(out)) out.copy_(o);
}

void paged_attention_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                             int64_t window_size, double softcap) {
  run_prefill(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, window_size,
              softcap, {});
}

void paged_attention_prefill_quantized(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, const at::Tensor& k_scale,
                                       const at::Tensor& v_scale, const at::Tensor& block_tables,
                                       const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                                       int64_t window_size, double softcap) {
  run_prefill(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, window_size,
              softcap, {&k_scale, &v_scale});
}

}  // namespace
}  // namespace pagellm::cuda

TORCH_LIBRARY_IMPL(pagellm, CUDA, m) {
  m.impl("paged_attention_decode", &pagellm::cuda::paged_attention_decode);
  m.impl("paged_attention_prefill", &pagellm::cuda::paged_attention_prefill);
  m.impl("paged_attention_decode_quantized", &pagellm::cuda::paged_attention_decode_quantized);
  m.impl("paged_attention_prefill_quantized", &pagellm::cuda::paged_attention_prefill_quantized);
}
