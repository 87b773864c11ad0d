// Every torch.ops.pagellm.* schema, in one place. Device kernels register themselves with
// TORCH_LIBRARY_IMPL(pagellm, CPU|CUDA, m) in csrc/ops/<family>/*_cpu.cpp / *_cuda.cpp.
// Conventions: outputs first, mutated tensors annotated Tensor(x!), every op returns () (fused_moe: its output),
// no stream arguments (the CUDA side uses the current stream). The KV-cache layout is docs/kv_cache_layout.md.
#include <torch/library.h>

TORCH_LIBRARY(pagellm, m) {
  // ---- cache_ops ----
  m.def(
      "reshape_and_cache(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, "
      "Tensor slot_mapping) -> ()");
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  // For every (src, dst) row of slot_mapping (int64 [num_pairs, 2], slot = block * block_size + offset) and every cache
  // tensor [num_blocks, num_kv_heads, block_size, ...] (any dtype: values or scales): the rows at slot dst = those at
  // slot src, every source read before any destination is written (a destination named twice: the later pair's row): a
  // tree's accepted path moved to its row's first lookahead slots.
  m.def("copy_slots(Tensor(a!)[] caches, Tensor slot_mapping) -> ()");
  // Quantized caches (int8 / float8_e4m3fn values + float32 scales [num_blocks, num_kv_heads, block_size], one per
  // row): every written (token, head) row is quantized by its absmax (pagellm.ops.reference has the exact rule).
  m.def(
      "reshape_and_cache_quantized(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor(c!) k_scale, "
      "Tensor(d!) v_scale, Tensor key, Tensor value, Tensor slot_mapping) -> ()");

  // ---- paged_attention ----
  m.def(
      "paged_attention_decode(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int window_size=-1, float softcap=0.0) -> ()");
  m.def(
      "paged_attention_prefill(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, int window_size=-1, "
      "float softcap=0.0) -> ()");
  // The same over a quantized cache (value = stored * scale of its row).
  m.def(
      "paged_attention_decode_quantized(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor k_scale, Tensor v_scale, Tensor block_tables, Tensor seq_lens, float scale, int window_size=-1, "
      "float softcap=0.0) -> ()");
  m.def(
      "paged_attention_prefill_quantized(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor k_scale, Tensor v_scale, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, "
      "int window_size=-1, float softcap=0.0) -> ()");

  // MLA decode (DeepSeek-V2/V3, absorbed weights): one query token per sequence over the latent cache
  // [num_blocks, block_size, latent_dim] as one KV head whose keys are the latent rows and whose values are their
  // first kv_lora_rank = out.size(2) dims; out [T, H, kv_lora_rank], query [T, H, latent_dim] (reference:
  // pagellm.ops.mla_reference.paged_mla_decode). CUDA: latent_dim 576, kv_lora_rank 512.
  m.def(
      "paged_mla_decode(Tensor(a!) out, Tensor query, Tensor latent_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale) -> ()");

  // ---- tree_attention (Medusa verification) ----
  // Sequence i's q_len = qsl[i+1] - qsl[i] tree tokens are the LAST q_len positions of its seq_lens[i] keys (already
  // cached); each sees the whole committed context plus the tree tokens j with tree_mask[token][j] != 0
  // (bool / uint8 [num_tokens, max_tree_tokens]: its ancestors and itself). Float caches only.
  m.def(
      "paged_tree_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, Tensor tree_mask, float scale, "
      "float softcap=0.0) -> ()");

  // ---- norm_rope ----
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox) -> ()");

  // ---- fused (CUDA only; each is two ops above in one kernel, with their bits) ----
  // rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox), then
  // reshape_and_cache(key_cache, value_cache, key, value, slot_mapping) with key / value viewed as
  // [T, num_kv_heads, head_size]: float caches.
  m.def(
      "rotary_embedding_and_cache(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor value, "
      "Tensor(c!) key_cache, Tensor(d!) value_cache, Tensor slot_mapping, int head_size, Tensor cos_sin_cache, "
      "bool is_neox) -> ()");
  // out = linear_gemv(rms_norm(x) * norm_weight, weight, bias, kernel, pdl); with residual (and residual_out, which
  // must not overlap x or residual): residual_out = x + residual (rounded), and the norm of that sum, as
  // fused_add_rms_norm computes it (x and residual are not modified). kernel: 2, 3 or 4.
  m.def(
      "rms_norm_linear(Tensor(a!) out, Tensor(b!)? residual_out, Tensor x, Tensor? residual, Tensor norm_weight, "
      "float epsilon, Tensor weight, Tensor? bias, int kernel=4, bool pdl=False) -> ()");
  // out = linear_gemv(silu_and_mul(x), weight, bias, kernel, pdl): x [M, 2K] gate | up, weight [N, K].
  m.def("silu_and_mul_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, int kernel=4, bool pdl=False) -> ()");

  // ---- activation ----
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def("gelu_and_mul(Tensor(a!) out, Tensor input, str approximate=\"none\") -> ()");

  // ---- sampling ----
  // out[r] = argmax(logits[r, :]) (int64 [N]): the first index of the row's maximum, a NaN counting as the maximum
  // (torch.argmax's rule, exact in every float dtype); logits [N, V] float32 / bfloat16 / float16. CPU only.
  m.def("argmax_rows(Tensor(a!) out, Tensor logits) -> ()");

  // ---- indexing ----
  // out[i, :] = src[index[i], :]: out / src [N, D] / [R, D] of one dtype, index int64 / int32 [N] in [0, R)
  // (every index checked before a row is written). CPU only (the embedding lookup, logits rows' hidden states).
  m.def("gather_rows(Tensor(a!) out, Tensor src, Tensor index) -> ()");

  // ---- lora ----
  // y[t] += scales[s] * lora_b[s] @ (lora_a[s] @ x[t]) for s = token_slots[t] >= 0 (-1: none); y [T, N], x [T, K],
  // lora_a [S, R, K], lora_b [S, N, R] (x's dtype, ranks < R zero-padded), scales float32 [S], token_slots int32 [T].
  m.def("lora_apply(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scales, Tensor token_slots) -> ()");

  // ---- linear ----
  // out[M, N] = x[M, K] @ weight[N, K]^T (+ bias[N]); weight-streaming kernel for small M (decode).
  m.def("linear_small_m(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  // The same product on CUDA with a chosen GEMV kernel (docs/cuda.md, linear_gemv): kernel 1 = linear_small_m's
  // warp-per-column kernel, 2 = split-K over the warps of a CTA (~512 CTAs), 3 = the same split for ~1024 CTAs,
  // 4 = kernel 2 with fewer registers at M <= 2; pdl: kernels 2-4 launch as programmatic dependents (sm_90) and
  // fetch weights before the kernel before them ends. bf16 / fp16 / fp32; a row's bits do not depend on M. CUDA only.
  m.def("linear_gemv(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, int kernel=2, bool pdl=False) -> ()");
  // bf16 only, on Intel AMX tiles (CPU only; pagellm._C.cpu_has_amx_bf16() says whether it can run).
  m.def("linear_amx(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  // out[m] = argmax_n of linear_small_m's out[m, n] (int64 [M]: the first index of the row's maximum, a NaN counting
  // as the maximum, as argmax_rows); at M = 1 the logits are never stored (the greedy LM head). CPU only.
  m.def("linear_argmax(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  // The ceiling of the loaded CPU kernel library's bf16 pair dot product, for benchmarks' MFU: num_iters (<= 2^20)
  // rounds of 12 independent vdpbf16ps (64 FLOP each) in registers; out float32 [16] = 12 * num_iters * 2^-6.
  m.def("bf16_dot_peak(Tensor(a!) out, int num_iters) -> ()");

  // ---- moe: the routed experts of a mixture-of-experts MLP (contract: python/pagellm/ops/moe_reference.py) ----
  // out[T, H] = sum_j topk_weights[t, j] * w2[e] @ (act(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)), e = topk_ids[t, j];
  // hidden [T, H], w13 [E, 2I, H], w2 [E, H, I] float32 / bfloat16 / float16; topk_weights float32 / topk_ids
  // int32 [T, k]; activation "silu" or "gelu_tanh". fp32 math, one rounding. Returns a new tensor.
  m.def(
      "fused_moe(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation) "
      "-> Tensor");

  // ---- quant: int8 (LLM.int8()) ----
  // out[M, N] = x[M, K] @ (weight_int8[N, K] * weight_scale[N, None])^T (+ bias[N]): columns of x with
  // |x| > threshold in any row in fp32, the rest quantized per row to int8 (int32 dot products); threshold 0 =
  // no outlier columns. zero_point: rows quantized asymmetrically to uint8 with an integer zero point instead of
  // by their absmax (K < 65536). group_size > 0 (a multiple of 64, zero_point False): one absmax scale per group
  // of group_size elements of K per row (per-token-group), each group's int32 sum scaled and summed in fp32.
  // x, out, bias: float32 / bfloat16 / float16; weight_scale float32.
  m.def(
      "int8_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, "
      "float threshold=6.0, bool zero_point=False, int group_size=0) -> ()");

  // ---- quant: GGUF blocks (csrc/ops/quant/gguf_blocks.h) ----
  // out[M, N] = x[M, K] @ dequant(qweight)^T (+ bias[N]), K = in_features (a multiple of 32); qweight uint8
  // [N, K / 32 * block_bytes] in GGUF's own block layout; qtype = ggml type id: 2 Q4_0, 3 Q4_1, 8 Q8_0.
  // x, out, bias: float32 / bfloat16 / float16 (fp32 accumulation, one rounding).
  m.def("gguf_linear(Tensor(a!) out, Tensor x, Tensor qweight, int qtype, int in_features, Tensor? bias) -> ()");

  // ---- quant: AWQ 4-bit groups (csrc/ops/quant/awq_layout.h) ----
  // out[M, N] = x[M, K] @ W^T (+ bias[N]), W[n, k] = (q[n, k] - zeros[n, k / G]) * scales[n, k / G]: qweight
  // uint8 [N, K / 2] (blocks of 32 along K, low nibbles first), scales float32 / zeros uint8 [N, K / G];
  // G = group_size, a multiple of 32 dividing K. x, out, bias: float32 / bfloat16 / float16 (fp32 accumulation).
  m.def(
      "awq_linear(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size, "
      "Tensor? bias) -> ()");
}
