// fused_decode_layer: the rest of a Llama-family decoder layer after its input norm (qkv projection,
// optional q/k RMSNorm, rope, KV-cache write, paged decode attention, o projection, post-attention
// add+norm, gated MLP), for a decode-only batch, as ONE op.
//
// Why: at batch 1 on a small model the kernels are fast (~0.5 ms per layer for SmolLM2-135M) but each
// op called from Python costs 3-8 us of argument parsing and dispatch; the module path makes ~30 such
// calls per layer, a third of the decode step. This op is the same sequence of the same registered
// ops (looked up once through the dispatcher), in the same order as pagellm/models/llama.py, so its
// results are bit-identical to the module path (tests/models/test_fused_decode.py). It holds no
// kernels of its own. Linear layers choose exactly as pagellm.layers.linear.linear does
// (ops/linear/linear_choice.h): small-M kernel, AMX tile kernel or at::linear by dtype and row count.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

#include "ops/common/checks.h"
#include "ops/linear/linear_choice.h"

namespace pagellm::cpu {
namespace {

using OptTensor = std::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// Handles of the ops the layer is made of, looked up once.
struct LayerOps {
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&)> linear_small_m =
      find_op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&)>("pagellm::linear_small_m");
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&)> linear_amx =
      find_op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&)>("pagellm::linear_amx");
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, double)> rms_norm =
      find_op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>("pagellm::rms_norm");
  c10::TypedOperatorHandle<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)> fused_add_rms_norm =
      find_op<void(at::Tensor&, at::Tensor&, const at::Tensor&, double)>("pagellm::fused_add_rms_norm");
  c10::TypedOperatorHandle<void(const at::Tensor&, at::Tensor&, at::Tensor&, int64_t, const at::Tensor&, bool)>
      rotary_embedding = find_op<void(const at::Tensor&, at::Tensor&, at::Tensor&, int64_t, const at::Tensor&, bool)>(
          "pagellm::rotary_embedding");
  c10::TypedOperatorHandle<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>
      reshape_and_cache =
          find_op<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
              "pagellm::reshape_and_cache");
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, int64_t, double)>
      paged_attention_decode =
          find_op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, double, int64_t, double)>("pagellm::paged_attention_decode");
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&)> silu_and_mul =
      find_op<void(at::Tensor&, const at::Tensor&)>("pagellm::silu_and_mul");
  c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, c10::string_view)> gelu_and_mul =
      find_op<void(at::Tensor&, const at::Tensor&, c10::string_view)>("pagellm::gelu_and_mul");

  static const LayerOps& get() {
    static const LayerOps ops;
    return ops;
  }
};

LinearPath linear_path(const at::Tensor& x, const at::Tensor& w, const OptTensor& b) {
  const bool bf16 = x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
                    (!b.has_value() || !b->defined() || b->scalar_type() == at::kBFloat16);
  return bf16 ? choose_bf16_linear(x.size(0), amx::amx_bf16_usable()) : LinearPath::kAten;
}

// out = x @ w^T (+ b) for 2-D x, written into `out` when given.
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const OptTensor& b, at::Tensor out = at::Tensor()) {
  const LinearPath path = linear_path(x, w, b);
  if (path != LinearPath::kAten) {
    if (!out.defined()) out = at::empty({x.size(0), w.size(0)}, x.options());
    if (path == LinearPath::kSmallM) LayerOps::get().linear_small_m.call(out, x, w, b);
    else LayerOps::get().linear_amx.call(out, x, w, b);
    return out;
  }
  at::Tensor y = at::linear(x, w, b.has_value() && b->defined() ? *b : at::Tensor());
  if (!out.defined()) return y;
  out.copy_(y);
  return out;
}

// RMSNorm over each head of a [T, heads * head_dim] slice (Qwen3's q_norm / k_norm); a new tensor.
at::Tensor head_rms_norm(const at::Tensor& x, const at::Tensor& weight, int64_t heads, int64_t head_dim, double eps) {
  const int64_t T = x.size(0);
  at::Tensor rows = x.reshape({T * heads, head_dim});
  at::Tensor out = at::empty(rows.sizes(), rows.options());
  LayerOps::get().rms_norm.call(out, rows, weight, eps);
  return out.view({T, heads * head_dim});
}

void fused_decode_layer(at::Tensor& out, const at::Tensor& hidden, at::Tensor& residual, const at::Tensor& positions,
                        at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& qkv_weight,
                        const OptTensor& qkv_bias, const OptTensor& q_norm_weight, const OptTensor& k_norm_weight,
                        const at::Tensor& cos_sin_cache, bool is_neox, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, double scale, int64_t window_size, double softcap,
                        const at::Tensor& o_weight, const OptTensor& o_bias, const at::Tensor& post_norm_weight,
                        double eps, const at::Tensor& gate_up_weight, const OptTensor& gate_up_bias,
                        const at::Tensor& down_weight, const OptTensor& down_bias, c10::string_view act) {
  const LayerOps& ops = LayerOps::get();
  check_cpu(hidden, "hidden");
  check_float(hidden, "hidden");
  check_dim(hidden, 2, "hidden");
  const int64_t T = hidden.size(0), H = hidden.size(1);
  TORCH_CHECK(residual.sizes() == hidden.sizes() && out.sizes() == hidden.sizes(), "out and residual must have the ",
              "shape of hidden ", hidden.sizes(), ", got ", out.sizes(), " and ", residual.sizes());
  check_same_dtype(out, hidden, "out", "hidden");
  check_last_contiguous(out, "out");
  TORCH_CHECK(positions.numel() == T && seq_lens.dim() == 1 && seq_lens.size(0) == T,
              "a decode batch has one token per sequence: hidden has ", T, " rows, positions ", positions.numel(),
              ", seq_lens ", seq_lens.sizes());
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0, "num_heads, num_kv_heads and head_dim must be ",
              "positive, got ", num_heads, ", ", num_kv_heads, ", ", head_dim);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(qkv_weight.dim() == 2 && qkv_weight.size(0) == q_size + 2 * kv_size, "qkv_weight must have ",
              q_size + 2 * kv_size, " rows (q ", q_size, " + k, v ", kv_size, " each), got shape ", qkv_weight.sizes());
  TORCH_CHECK(act == "silu" || act == "gelu" || act == "gelu_tanh", "act must be 'silu', 'gelu' or 'gelu_tanh', got '",
              std::string(act), "'");
  TORCH_CHECK(q_norm_weight.has_value() == k_norm_weight.has_value(),
              "give both q_norm_weight and k_norm_weight, or neither");
  TORCH_CHECK(down_weight.dim() == 2 && down_weight.size(0) == H, "down_weight must have ", H,
              " rows (the hidden size), got shape ", down_weight.sizes());
  if (T == 0) return;

  // Attention: q, k, v are strided column slices of the merged projection (no copies).
  at::Tensor qkv = project(hidden, qkv_weight, qkv_bias);
  at::Tensor q = qkv.narrow(1, 0, q_size);
  at::Tensor k = qkv.narrow(1, q_size, kv_size);
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
  if (q_norm_weight.has_value()) {
    q = head_rms_norm(q, *q_norm_weight, num_heads, head_dim, eps);
    k = head_rms_norm(k, *k_norm_weight, num_kv_heads, head_dim, eps);
  }
  ops.rotary_embedding.call(positions, q, k, head_dim, cos_sin_cache, is_neox);
  const at::Tensor q3 = q.view({T, num_heads, head_dim});
  ops.reshape_and_cache.call(key_cache, value_cache, k.view({T, num_kv_heads, head_dim}),
                             v.view({T, num_kv_heads, head_dim}), slot_mapping);
  at::Tensor attn = at::empty({T, num_heads, head_dim}, hidden.options());
  ops.paged_attention_decode.call(attn, q3, key_cache, value_cache, block_tables, seq_lens, scale, window_size,
                                  softcap);
  at::Tensor h = project(attn.view({T, q_size}), o_weight, o_bias);

  // Post-attention norm (residual += h; h = norm(residual)), then the gated MLP into `out`.
  ops.fused_add_rms_norm.call(h, residual, post_norm_weight, eps);
  const at::Tensor gate_up = project(h, gate_up_weight, gate_up_bias);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up_weight must have an even number of rows, got ", gate_up_weight.sizes());
  at::Tensor a = at::empty({T, gate_up.size(1) / 2}, hidden.options());
  if (act == "silu") {
    ops.silu_and_mul.call(a, gate_up);
  } else {
    ops.gelu_and_mul.call(a, gate_up, act == "gelu" ? "none" : "tanh");
  }
  project(a, down_weight, down_bias, out);
}

}  // namespace
}  // namespace pagellm::cpu

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("fused_decode_layer", &pagellm::cpu::fused_decode_layer); }
