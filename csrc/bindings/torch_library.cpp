// Every torch.ops.pagellm.* schema, in one place. Device kernels register themselves with
// TORCH_LIBRARY_IMPL(pagellm, CPU|CUDA, m) in csrc/ops/<family>/*_cpu.cpp / *_cuda.cpp.
// Conventions: outputs first, mutated tensors annotated Tensor(x!), every op returns (), no stream
// arguments (the CUDA side uses the current stream). The KV-cache layout is docs/kv_cache_layout.md.
#include <torch/library.h>

TORCH_LIBRARY(pagellm, m) {
  // ---- cache_ops ----
  m.def(
      "reshape_and_cache(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, "
      "Tensor slot_mapping) -> ()");
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");

  // ---- paged_attention ----
  m.def(
      "paged_attention_decode(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int window_size=-1, float softcap=0.0) -> ()");
  m.def(
      "paged_attention_prefill(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, int window_size=-1, "
      "float softcap=0.0) -> ()");

  // ---- norm_rope ----
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox) -> ()");

  // ---- activation ----
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def("gelu_and_mul(Tensor(a!) out, Tensor input, str approximate=\"none\") -> ()");

  // ---- linear ----
  // out[M, N] = x[M, K] @ weight[N, K]^T (+ bias[N]); weight-streaming kernel for small M (decode).
  m.def("linear_small_m(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  // bf16 only, on Intel AMX tiles (CPU only; pagellm._C.cpu_has_amx_bf16() says whether it can run).
  m.def("linear_amx(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
}
