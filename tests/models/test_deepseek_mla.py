"""DeepSeek-V2 / V3 (multi-head latent attention) vs transformers on tiny random weights (float32): prompt
logprobs and 32 greedy tokens through the paged latent cache; the MLA decode op vs its reference; YaRN vs
transformers; bad configs refused before any weight is read."""

from __future__ import annotations

import functools
import json
import math
import random

import pytest
import torch
import transformers as tf

from paged_model_utils import (
    available_backends, hf_greedy_batch, hf_prompt_logprobs, make_backend, make_tiny_hf, paged_greedy,
    paged_prompt_logprobs, random_prompts,
)
from pagellm.kv_cache.spec import MLAAttentionSpec
from pagellm.layers.rotary import compute_inv_freq
from pagellm.model_loader import build_model, open_model
from pagellm.ops import mla as mla_ops
from pagellm.ops import mla_reference, ops_available
from scheduler_probes import CountingScheduler

LENGTHS = [1, 17, 40]  # cross the 16-token block boundary
NEW_TOKENS = 32
# MLA reads only the step's metadata from the attention backend (its K/V kernels are unused), so one backend
# covers it: the C++ one when built
BACKEND = available_backends()[-1]

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0,
            mscale_all_dim=0.8, beta_fast=32, beta_slow=1)
V2, V3 = (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM), (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM)
CASES = {
    # first_k_dense_replace = num_hidden_layers: every MLP dense
    "v2_dense": (V2, dict(q_lora_rank=None, first_k_dense_replace=2)),
    "v2_dense_qlora_yarn": (V2, dict(q_lora_rank=24, first_k_dense_replace=2, rope_parameters=YARN)),
    "v2_moe_greedy": (V2, dict(q_lora_rank=None, first_k_dense_replace=1, topk_method="greedy",
                               routed_scaling_factor=1.5)),
    "v2_moe_group_limited": (V2, dict(q_lora_rank=24, first_k_dense_replace=0, topk_method="group_limited_greedy",
                                      n_group=4, topk_group=2)),
    "v3_noaux_tc_yarn": (V3, dict(q_lora_rank=24, first_k_dense_replace=1, n_group=4, topk_group=2,
                                  routed_scaling_factor=2.0, rope_parameters=YARN)),
    # latent 24 + 16 = 40, not a multiple of 16: decodes take the masked pure-torch path, not the kernel
    "v3_no_interleave": (V3, dict(q_lora_rank=None, first_k_dense_replace=1, n_group=2, topk_group=1,
                                  norm_topk_prob=False, rope_interleave=False, kv_lora_rank=24)),
}
# greedy decoding costs most (transformers' generate): these cases check prompt logprobs only, the
# same MoE routing with greedy decoding being covered by the others
LOGPROBS_ONLY = {"v2_moe_greedy"}


def make_tiny_deepseek(name: str):
    (cfg_cls, model_cls), overrides = CASES[name]
    hf = make_tiny_hf(cfg_cls, model_cls, seed=len(name), **{**MLA, **overrides})
    g = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for layer in hf.model.layers:  # a buffer transformers leaves at zero: give the routing a real bias
            bias = getattr(layer.mlp, "gate", None) and getattr(layer.mlp.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(0.1 * torch.randn(bias.shape, generator=g))
    return hf


@functools.lru_cache(maxsize=None)
def _case(name: str, tmp_root: str):
    hf = make_tiny_deepseek(name)
    path = f"{tmp_root}/{name}"
    hf.save_pretrained(path)
    model = build_model(open_model(path), dtype="float32")
    prompts = random_prompts(LENGTHS, hf.config.vocab_size, seed=len(name))
    ref_gen = None if name in LOGPROBS_ONLY else hf_greedy_batch(hf, prompts, NEW_TOKENS)
    return hf, model, prompts, [hf_prompt_logprobs(hf, p) for p in prompts], ref_gen


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("deepseek"))


@pytest.mark.parametrize("name", list(CASES))
def test_prompt_logprobs_and_greedy_match_hf(name, tmp_root):
    hf, model, prompts, ref_lp, ref_gen = _case(name, tmp_root)
    backend = BACKEND
    be = make_backend(backend)
    for bs in (1, 16):
        for p, a, b in zip(prompts, paged_prompt_logprobs(model, be, prompts, bs, seed=bs), ref_lp):
            err = (a - b).abs().max().item()
            assert err < 1e-4, f"{name}/{backend}/block {bs}: prompt len {len(p)} max |dlogprob| {err}"
    if ref_gen is None:
        return
    # greedy: prefill, then absorbed decodes over the latent cache, the last prompt joining as a mixed batch
    gen = paged_greedy(model, be, prompts, NEW_TOKENS, 16, seed=5)
    for i, (g, r) in enumerate(zip(gen, ref_gen)):
        assert g == r, f"{name}/{backend}: prompt {i} greedy differs\n{g}\n{r}"


def test_absorbed_decode_logprobs_match_hf(tmp_root):
    """Per-step decode logprobs (absorbed weights over the latent cache) vs HF's full forward of prompt + tokens."""
    hf, model, prompts, _, _ = _case("v3_noaux_tc_yarn", tmp_root)
    gen, lps = paged_greedy(model, make_backend(BACKEND), prompts[1:], 8, 16, return_logprobs=True)
    for p, g, steps in zip(prompts[1:], gen, lps):
        full = hf_prompt_logprobs(hf, p + g)
        for j, lp in enumerate(steps):
            assert (lp - full[len(p) - 1 + j]).abs().max().item() < 1e-4


def test_bf16_close_to_hf(tmp_root):
    """bf16 serving of the float32 checkpoint stays close to HF bf16 (not bit-exact: op order differs)."""
    _, _, prompts, _, _ = _case("v2_dense_qlora_yarn", tmp_root)
    path = f"{tmp_root}/v2_dense_qlora_yarn"
    model = build_model(open_model(path), dtype="bfloat16")
    hf16 = tf.DeepseekV2ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()  # not the cached fp32 one
    gen, lps = paged_greedy(model, make_backend(BACKEND), prompts[1:], 4, 16, return_logprobs=True)
    for p, g, steps in zip(prompts[1:], gen, lps):
        full = hf_prompt_logprobs(hf16, p + g)
        assert (paged_prompt_logprobs(model, make_backend(BACKEND), [p], 16)[0] - full[: len(p)]).abs().max() < 0.15
        for j, lp in enumerate(steps):  # decodes: absorbed in bf16
            assert (lp - full[len(p) - 1 + j]).abs().max().item() < 0.15


def test_kv_cache_specs_are_latent(tmp_root):
    _, model, *_ = _case("v2_dense", tmp_root)
    specs = model.kv_cache_specs(16, torch.float32)
    assert set(specs) == {0, 1}
    assert all(s == MLAAttentionSpec(16, MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"], torch.float32)
               for s in specs.values())
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.window_sizes) == (2, 1, 48, [-1, -1])
    # one 48-value row per token instead of K and V for 4 heads of 32 / 16 dims
    assert specs[0].page_size_bytes == 16 * 48 * 4
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'"):
        model.kv_cache_specs(16, "int8")
    # layers past num_hidden_layers (V3's multi-token-prediction layer) are dropped, as transformers does
    assert model.load_weights([("model.layers.2.self_attn.o_proj.weight", torch.zeros(64, 64))]) == set()
    with pytest.raises(ValueError, match="quantized weights"):
        build_model(open_model(f"{tmp_root}/v2_dense"), dtype="float32", quantization="int8")


# ---------------------------------------------------------------- the MLA decode op
def _random_latent_batch(seq_lens, block_size, latent_dim, num_heads, seed):
    g = torch.Generator().manual_seed(seed)
    width = max(math.ceil(n / block_size) for n in seq_lens) + 1
    num_blocks = width * len(seq_lens) + 2
    cache = torch.randn(num_blocks, block_size, latent_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: width * len(seq_lens)].view(len(seq_lens), width).to(torch.int32)
    query = torch.randn(len(seq_lens), num_heads, latent_dim, generator=g)
    return query, cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 48, 80, 576 (DeepSeek's 512 + 64): the compiled kernel on CPU; 40: the masked path
@pytest.mark.parametrize("latent_dim", [48, 40, 80, 576])
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_mla_decode_matches_reference(latent_dim, block_size, dtype):
    seq_lens = [1, 15, 16, 17, 33, 5]
    kv_lora_rank = latent_dim - (64 if latent_dim == 576 else 16)
    query, cache, tables, lens = _random_latent_batch(seq_lens, block_size, latent_dim, 3, seed=latent_dim)
    query, cache = query.to(dtype), cache.to(dtype)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    ref = mla_reference.paged_mla_decode(query, cache, tables, lens, 0.17, kv_lora_rank)
    got = mla_ops.paged_mla_decode(query, cache, tables, lens, 0.17, kv_lora_rank)
    assert got.shape == (len(seq_lens), 3, kv_lora_rank) and got.dtype == dtype
    torch.testing.assert_close(got, ref, **tol)
    for chunk_tokens in (2048, 16):  # one chunk; several (the online softmax across chunks)
        masked = mla_ops._masked_decode(query, cache, tables, lens, 0.17, kv_lora_rank, chunk_tokens)
        torch.testing.assert_close(masked, ref, **tol)
    compiled = ops_available()[0]
    assert mla_ops.decode_kernel_supported(torch.device("cpu"), latent_dim) == (compiled and latent_dim % 16 == 0)


def test_absorbed_decode_equals_expanded_attention():
    """W_UK folded into the query and W_UV applied after = per-head attention over expanded k / v."""
    g = torch.Generator().manual_seed(0)
    H, dn, dr, dv, r, S = 3, 8, 16, 12, 32, 21
    latent = torch.randn(S, r + dr, generator=g)
    w_kv = torch.randn(H, dn + dv, r, generator=g) / 4
    q_nope, q_pe = torch.randn(H, dn, generator=g), torch.randn(H, dr, generator=g)
    kv = torch.einsum("hor,sr->hso", w_kv, latent[:, :r])
    k = torch.cat([kv[..., :dn], latent[None, :, r:].expand(H, -1, -1)], dim=-1)
    probs = torch.softmax(torch.einsum("hd,hsd->hs", torch.cat([q_nope, q_pe], -1), k) * 0.2, dim=-1)
    expanded = torch.einsum("hs,hsd->hd", probs, kv[..., dn:])
    cache = latent.view(1, S, r + dr)  # one block of S rows
    q_lat = torch.einsum("hd,hdr->hr", q_nope, w_kv[:, :dn])
    o_lat = mla_reference.paged_mla_decode(torch.cat([q_lat, q_pe], -1)[None], cache,
                                           torch.zeros(1, 1, dtype=torch.int32), torch.tensor([S], dtype=torch.int32),
                                           0.2, r)[0]
    torch.testing.assert_close(torch.einsum("hr,hdr->hd", o_lat, w_kv[:, dn:]), expanded, atol=1e-5, rtol=1e-5)


def test_write_latent_skips_negative_slots():
    cache = torch.zeros(4, 16, 48)
    ref = cache.clone()
    rows = torch.randn(5, 48)
    slots = torch.tensor([0, 17, -1, 63, 20], dtype=torch.int64)
    mla_ops.write_latent(cache, rows, slots)
    mla_reference.write_latent(ref, rows, slots)
    assert torch.equal(cache, ref)
    assert torch.equal(cache.view(-1, 48)[17], rows[1]) and cache.view(-1, 48).abs().sum(-1).nonzero().numel() == 4


# ---------------------------------------------------------------- YaRN
@pytest.mark.parametrize("params", [
    YARN,
    dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=128, mscale=1.0,
         mscale_all_dim=1.0, beta_fast=32, beta_slow=1),
    dict(rope_type="yarn", rope_theta=500.0, factor=8.0, original_max_position_embeddings=32, truncate=False),
])
def test_yarn_matches_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tf.DeepseekV3Config(**{**MLA, "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 512,
                                    "rope_parameters": dict(params)})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours, factor, _ = compute_inv_freq(dict(params), MLA["qk_rope_head_dim"], 512)
    torch.testing.assert_close(ours, inv_freq, rtol=0, atol=0)
    assert factor == pytest.approx(attention_factor, rel=1e-12)


def test_llama_with_yarn_matches_hf(tmp_path):
    """YaRN in layers/rotary.py serves every model, not only MLA: a Llama with it, prompt logprobs vs HF."""
    hf = make_tiny_hf(tf.LlamaConfig, tf.LlamaForCausalLM, seed=4, head_dim=16,
                      rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                           original_max_position_embeddings=32))
    hf.save_pretrained(tmp_path)
    model = build_model(open_model(tmp_path), dtype="float32")
    prompts = random_prompts([70], hf.config.vocab_size, seed=4)  # past original_max_position_embeddings
    (got,) = paged_prompt_logprobs(model, make_backend(BACKEND), prompts, 16)
    assert (got - hf_prompt_logprobs(hf, prompts[0])).abs().max().item() < 1e-4


# ---------------------------------------------------------------- bad configs
@pytest.mark.parametrize("field,value,extra", [
    ("kv_lora_rank", None, {}),
    ("kv_lora_rank", 0, {}),
    ("rope_parameters", {"rope_type": "bogus", "rope_theta": 10000.0}, {}),
    ("num_experts_per_tok", 9, {"first_k_dense_replace": 1}),
])
def test_bad_config_refused_before_weights(field, value, extra, tmp_path):
    config = tf.DeepseekV2Config(**{**MLA, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                                    "first_k_dense_replace": 2, "vocab_size": 64}).to_dict()
    config.update({field: value, "architectures": ["DeepseekV2ForCausalLM"], **extra})
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")  # reading it would fail differently
    name = "rope_type" if field == "rope_parameters" else field
    with pytest.raises(ValueError, match=name):
        build_model(open_model(tmp_path), dtype="float32")


# ---------------------------------------------------------------- the engine on an MLA model
@pytest.fixture(scope="module")
def v2_dir(tmp_root):
    _case("v2_dense_qlora_yarn", tmp_root)
    return f"{tmp_root}/v2_dense_qlora_yarn"


def _greedy_params(n=NEW_TOKENS):
    from pagellm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_engine_prefix_cache_and_preemption_match_hf(v2_dir, tmp_root):
    pytest.importorskip("pagellm._C", reason="the engine's scheduler is C++")
    from pagellm import LLM

    hf = _case("v2_dense_qlora_yarn", tmp_root)[0]
    rng = random.Random(11)
    prefix = [rng.randrange(300) for _ in range(20)]
    prompts = [prefix + [rng.randrange(300) for _ in range(n)] for n in (3, 9, 1, 14)] + [[5, 6, 7]]
    expected = hf_greedy_batch(hf, prompts, 24)
    llm = LLM(v2_dir, block_size=4, num_kv_blocks=32, max_model_len=64, enable_prefix_caching=True, seed=0)
    eng = llm.llm_engine
    eng.scheduler = recorder = CountingScheduler(eng.scheduler)
    first = llm.generate({"prompt_token_ids": prompts[0]}, _greedy_params(24), use_tqdm=False)[0]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy_params(24), use_tqdm=False)
    assert first.outputs[0].token_ids == expected[0]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert recorder.num_preempted > 0, "the tiny cache should force preemption"
    assert max(o.num_cached_tokens for o in outs) >= 16  # the shared prefix came from the prefix cache


def test_engine_batch_invariance(v2_dir):
    pytest.importorskip("pagellm._C", reason="the engine's scheduler is C++")
    from pagellm import LLM, SamplingParams

    llm = LLM(v2_dir, max_model_len=128, seed=0)
    rng = random.Random(3)
    target = [rng.randrange(300) for _ in range(23)]
    alone = llm.generate({"prompt_token_ids": target}, _greedy_params(), use_tqdm=False)[0].outputs[0].token_ids
    others = [[rng.randrange(300) for _ in range(rng.randrange(2, 40))] for _ in range(9)]
    batch = others[:4] + [target] + others[4:]
    params = [SamplingParams(temperature=0.8, max_tokens=rng.randrange(2, 24), ignore_eos=True) for _ in batch]
    params[4] = _greedy_params()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert outs[4].outputs[0].token_ids == alone
    graphs = llm.llm_engine.executor.driver_worker.runner.step_graphs
    if graphs is not None:  # the MLA decode path is replayable: decode-only steps ran as step graphs
        assert graphs.num_replays > 0
