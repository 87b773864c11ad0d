// CPU glue for paged_attention_decode / paged_attention_prefill and their *_quantized forms (int8 / fp8 caches
// with per-row scales): validation of shapes, dtypes and (cheaply) every block-table entry a sequence will
// read, then the kernels in *_cpu_kernels.h.
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/paged_attention/attention_checks.h"
#include "ops/paged_attention/decode_cpu_kernels.h"
#include "ops/paged_attention/decode_runs_cpu_kernels.h"
#include "ops/paged_attention/mla_checks.h"
#include "ops/paged_attention/prefill_dispatch_cpu.h"

namespace pagellm::cpu {
namespace {

using Common = PagedAttentionShape;

// A quantized cache's k_scale / v_scale; both null for a float cache.
struct Scales {
  const at::Tensor* k = nullptr;
  const at::Tensor* v = nullptr;
};

// The decode kernel keeps its per-head accumulators in memory, so any multiple of 16 works; 1024 covers MLA's
// latent rows (DeepSeek: 512 + 64) read as one-head keys and values. Prefill stays at 512.
constexpr int64_t kMaxPrefillHeadDim = 512;
constexpr int64_t kMaxDecodeHeadDim = 1024;

Common check_common(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    Scales scales, int64_t max_head_dim) {
  check_cpu(out, "out");
  check_cpu(query, "query");
  check_cpu(key_cache, "key_cache");
  check_cpu(value_cache, "value_cache");
  check_cpu(block_tables, "block_tables");
  check_cpu(seq_lens, "seq_lens");
  if (scales.k != nullptr) {
    check_cpu(*scales.k, "k_scale");
    check_cpu(*scales.v, "v_scale");
  }
  check_float(query, "query");
  const Common c =
      check_paged_attention_shapes(out, query, key_cache, value_cache, block_tables, seq_lens, scales.k, scales.v);
  TORCH_CHECK(c.head_dim % 16 == 0 && c.head_dim >= 16 && c.head_dim <= max_head_dim,
              "key_cache: head_dim (dim 3) must be a multiple of 16 in [16, ", max_head_dim, "], got ", c.head_dim);
  return c;
}

// Checks 0 <= seq_len <= capacity and that the blocks the sequence reads are valid ids.
void check_tables(const at::Tensor& block_tables, const int32_t* lens, const Common& c) {
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1), stride = block_tables.stride(0);
  for (int64_t s = 0; s < block_tables.size(0); ++s) {
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= max_blocks * c.block_size, "seq_lens[", s, "] = ", lens[s],
                " is out of range [0, ", max_blocks * c.block_size, "] (block_tables width x block_size)");
    const int64_t used = (lens[s] + c.block_size - 1) / c.block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int32_t id = bt[s * stride + b];
      TORCH_CHECK(id >= 0 && id < c.num_blocks, "block_tables[", s, "][", b, "] = ", id, " is out of range [0, ",
                  c.num_blocks, ")");
    }
  }
}

template <typename T, typename C = T>
PagedAttnArgs<T, C> make_args(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& block_tables, const int32_t* lens,
                              const int32_t* qsl, const Common& c, double scale, int64_t window, double softcap,
                              Scales scales = {}) {
  int64_t log2_bs = 0;
  while ((int64_t{1} << log2_bs) < c.block_size) ++log2_bs;
  return PagedAttnArgs<T, C>{out.data_ptr<T>(), query.data_ptr<T>(), key_cache.data_ptr<C>(),
                             value_cache.data_ptr<C>(), block_tables.data_ptr<int32_t>(), lens, qsl,
                             block_tables.stride(0), block_tables.size(0), c.num_heads, c.num_kv_heads, c.head_dim,
                             c.block_size, log2_bs, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                             key_cache.stride(0), key_cache.stride(1), static_cast<float>(scale), window,
                             static_cast<float>(softcap),
                             scales.k != nullptr ? scales.k->data_ptr<float>() : nullptr,
                             scales.v != nullptr ? scales.v->data_ptr<float>() : nullptr};
}

// Calls fn(args) with the PagedAttnArgs of the query's float type and the cache's type (float = the query's;
// int8 / fp8 when scales are given).
template <typename Fn>
void dispatch_args(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_tables, const int32_t* lens,
                   const int32_t* qsl, const Common& c, double scale, int64_t window, double softcap, Scales scales,
                   const Fn& fn) {
  PAGELLM_DISPATCH_FLOAT_TYPES(query.scalar_type(), "paged_attention", [&] {
    using T = scalar_t;
    if (scales.k == nullptr) {
      fn(make_args<T>(out, query, key_cache, value_cache, block_tables, lens, qsl, c, scale, window, softcap));
      return;
    }
    PAGELLM_DISPATCH_KV_QUANT_TYPES(key_cache.scalar_type(), "paged_attention", [&] {
      fn(make_args<T, scalar_t>(out, query, key_cache, value_cache, block_tables, lens, qsl, c, scale, window,
                                softcap, scales));
    });
  });
}

void check_scalars(int64_t window_size, double softcap) {
  TORCH_CHECK(window_size == -1 || window_size > 0, "window_size must be -1 (full) or positive, got ", window_size);
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0 = off), got ", softcap);
}

void run_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                double scale, int64_t window_size, double softcap, Scales scales) {
  const Common c =
      check_common(out, query, key_cache, value_cache, block_tables, seq_lens, scales, kMaxDecodeHeadDim);
  check_scalars(window_size, softcap);
  TORCH_CHECK(query.size(0) == seq_lens.size(0), "query must have one token per sequence (", seq_lens.size(0),
              " from seq_lens), got shape ", query.sizes());
  if (query.size(0) == 0) return;
  auto lens = seq_lens.contiguous();
  check_tables(block_tables, lens.data_ptr<int32_t>(), c);
  dispatch_args(out, query, key_cache, value_cache, block_tables, lens.data_ptr<int32_t>(), nullptr, c, scale,
                window_size, softcap, scales, [](const auto& args) { paged_attention_decode_runs_kernel(args); });
}

void paged_attention_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, int64_t window_size, double softcap) {
  run_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, window_size, softcap, {});
}

// MLA decode: the decode kernel over the latent cache as one KV head (keys = values = latent rows) into a
// latent_dim-wide scratch, whose first kv_lora_rank dims are the result.
void paged_mla_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& latent_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  check_cpu(out, "out");
  check_cpu(query, "query");
  check_cpu(latent_cache, "latent_cache");
  const MlaDecodeShape s = check_paged_mla_decode(out, query, latent_cache, block_tables, seq_lens);
  const at::Tensor pages = latent_cache.view({s.num_blocks, 1, s.block_size, s.latent_dim});
  at::Tensor full = at::empty(query.sizes(), query.options());
  run_decode(full, query, pages, pages, block_tables, seq_lens, scale, -1, 0.0, {});
  out.copy_(full.narrow(2, 0, s.kv_lora_rank));
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
  const Common c =
      check_common(out, query, key_cache, value_cache, block_tables, seq_lens, scales, kMaxPrefillHeadDim);
  check_scalars(window_size, softcap);
  check_cpu(query_start_loc, "query_start_loc");
  check_dtype(query_start_loc, at::kInt, "query_start_loc");
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == S + 1,
              "query_start_loc must have shape [num_seqs + 1] = [", S + 1, "], got ", query_start_loc.sizes());
  auto lens = seq_lens.contiguous();
  auto qsl = query_start_loc.contiguous();
  const int32_t* l = lens.data_ptr<int32_t>();
  const int32_t* q = qsl.data_ptr<int32_t>();
  TORCH_CHECK(q[0] >= 0 && q[S] <= query.size(0), "query_start_loc must lie in [0, num_tokens = ", query.size(0),
              "], got first ", q[0], " last ", q[S]);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(q[s] <= q[s + 1], "query_start_loc must be non-decreasing, got [", s, "] = ", q[s], " > [", s + 1,
                "] = ", q[s + 1]);
    TORCH_CHECK(q[s + 1] - q[s] <= l[s], "seq_lens[", s, "] = ", l[s], " is smaller than the chunk's query length ",
                q[s + 1] - q[s]);
  }
  if (S == 0 || query.size(0) == 0) return;
  check_tables(block_tables, l, c);
  dispatch_args(out, query, key_cache, value_cache, block_tables, l, q, c, scale, window_size, softcap, scales,
                [](const auto& args) { run_paged_attention_prefill(args); });
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
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("paged_attention_decode", &pagellm::cpu::paged_attention_decode);
  m.impl("paged_mla_decode", &pagellm::cpu::paged_mla_decode);
  m.impl("paged_attention_prefill", &pagellm::cpu::paged_attention_prefill);
  m.impl("paged_attention_decode_quantized", &pagellm::cpu::paged_attention_decode_quantized);
  m.impl("paged_attention_prefill_quantized", &pagellm::cpu::paged_attention_prefill_quantized);
}
