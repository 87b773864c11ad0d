"""MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) vs transformers on tiny random weights written by the test: prompt
logprobs and 32 greedy tokens in float32 through a paged KV cache, batch invariance, bf16 end to end, transformers'
stacked expert tensors, and config errors raised before any weight is read."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import transformers as tf

from paged_model_utils import (
    available_backends, hf_greedy_batch, hf_prompt_logprobs, make_backend, make_tiny_hf, paged_greedy,
    paged_prompt_logprobs, random_prompts,
)
from pagellm.layers.moe import FusedMoE
from pagellm.model_loader import build_model, open_model
from pagellm.models.llama import LlamaMLP

LENGTHS = [1, 17, 45, 140]  # cross the 16- and 128-token block boundaries
NEW_TOKENS = 32
BLOCK_SIZES = [1, 16, 128]
BACKENDS = available_backends()
FAST_BACKEND = BACKENDS[-1]  # the compiled one when built ('cpu'): greedy decoding runs there only, for time

CASES = {
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16)),
    # layers 0 and 2 sparse (shared expert + 4 experts, top-2 unnormalized), layer 1 dense (mlp_only_layers)
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=False)),
    # decoder_sparse_step=2: layer 0 dense, layer 1 sparse (8 experts, top-3 renormalized)
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2,
        head_dim=32)),
}


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe"))


@functools.lru_cache(maxsize=None)
def _saved(name: str, tmp_root: str):
    """The tiny HF model of case `name`, saved under tmp_root/name."""
    cfg_cls, model_cls, overrides = CASES[name]
    hf = make_tiny_hf(cfg_cls, model_cls, seed=len(name), **overrides)
    hf.save_pretrained(f"{tmp_root}/{name}")
    return hf


@functools.lru_cache(maxsize=None)
def _case(name: str, tmp_root: str):
    hf = _saved(name, tmp_root)
    model = build_model(open_model(f"{tmp_root}/{name}"), dtype="float32")
    prompts = random_prompts(LENGTHS, hf.config.vocab_size, seed=len(name))
    ref_lp = [hf_prompt_logprobs(hf, p) for p in prompts]
    ref_gen = hf_greedy_batch(hf, prompts, NEW_TOKENS)
    return hf, model, prompts, ref_lp, ref_gen


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_prompt_logprobs_and_greedy(name, backend, tmp_root):
    hf, model, prompts, ref_lp, ref_gen = _case(name, tmp_root)
    be = make_backend(backend)
    for bs in BLOCK_SIZES:
        lps = paged_prompt_logprobs(model, be, prompts, bs, seed=bs)
        for p, a, b in zip(prompts, lps, ref_lp):
            err = (a - b).abs().max().item()
            assert err < 1e-4, f"{name}/{backend}/block {bs}: prompt len {len(p)} max |dlogprob| {err}"
    if backend != FAST_BACKEND:
        return
    gen = paged_greedy(model, be, prompts, NEW_TOKENS, 16, seed=17)
    for i, (g, r) in enumerate(zip(gen, ref_gen)):
        assert g == r, f"{name}/{backend}: prompt {i} greedy differs\n{g}\n{r}"


def test_layer_structure(tmp_root):
    _, model, *_ = _case("mixtral", tmp_root)
    assert all(isinstance(layer.block_sparse_moe.experts, FusedMoE) for layer in model.model.layers)
    assert not any(".mlp." in n for n, _ in model.named_parameters())  # HF's name, block_sparse_moe, only
    _, model, *_ = _case("qwen2_moe", tmp_root)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["Qwen2MoeSparseMoe", "LlamaMLP", "Qwen2MoeSparseMoe"]
    assert model.model.layers[0].mlp.experts.w13_weight.shape == (4, 64, 64)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    _, model, *_ = _case("qwen3_moe", tmp_root)
    assert isinstance(model.model.layers[0].mlp, LlamaMLP) and not hasattr(model.model.layers[1].mlp, "shared_expert")


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_batch_invariance(name, tmp_root):
    """A prompt's logprobs and greedy tokens do not depend on what else is in the batch (tokens routed elsewhere)."""
    hf, model, prompts, _, _ = _case(name, tmp_root)
    be = make_backend(FAST_BACKEND)
    target = prompts[2]
    others = random_prompts([3, 30, 9, 60, 1, 22], hf.config.vocab_size, seed=99)
    alone_lp = paged_prompt_logprobs(model, be, [target], 16)[0]
    batch_lp = paged_prompt_logprobs(model, be, others[:3] + [target] + others[3:], 16)[3]
    assert (alone_lp - batch_lp).abs().max().item() < 1e-5
    alone = paged_greedy(model, be, [target], NEW_TOKENS, 16)[0]
    in_batch = paged_greedy(model, be, others[:3] + [target] + others[3:], NEW_TOKENS, 16, seed=5)[3]
    assert in_batch == alone


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_bf16_end_to_end(name, tmp_root):
    """bf16 serving of the float32 checkpoint: experts and routers in bf16, close to HF bf16 (not bit-exact)."""
    hf, _, prompts, _, _ = _case(name, tmp_root)
    model = build_model(open_model(f"{tmp_root}/{name}"), dtype="bfloat16")
    assert model.model.layers[0].mlp.experts.w13_weight.dtype == torch.bfloat16
    hf16 = hf.to(torch.bfloat16)
    try:
        be = make_backend(FAST_BACKEND)
        lps = paged_prompt_logprobs(model, be, prompts[1:3], 16)
        for p, a in zip(prompts[1:3], lps):
            err = (a - hf_prompt_logprobs(hf16, p)).abs().mean().item()
            assert err < 0.05, f"{name}: mean |dlogprob| {err} vs HF bf16"
        gen = paged_greedy(model, be, prompts[1:3], 8, 16)
        assert all(len(g) == 8 and all(0 <= t < hf.config.vocab_size for t in g) for g in gen)
    finally:
        hf.float()


def test_loads_transformers_stacked_expert_tensors(tmp_root):
    """transformers 5.x holds experts stacked (`experts.gate_up_proj` [E, 2I, H]); those load as well as the
    per-expert names save_pretrained writes, and satisfy the completeness check."""
    hf, model, *_ = _case("qwen3_moe", tmp_root)
    state = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    fresh = type(model)(hf.config, torch.float32)
    loaded = fresh.load_weights(state.items())
    assert not fresh.expected_weight_names() - loaded
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("name,field,value,match", [
    ("mixtral", "num_experts_per_tok", 5, r"num_experts_per_tok=5 must be in \[1, num_local_experts=4\]"),
    ("qwen2_moe", "num_experts_per_tok", 7, r"num_experts_per_tok=7 must be in \[1, num_experts=4\]"),
    ("qwen3_moe", "decoder_sparse_step", 0, r"decoder_sparse_step=0 must be an integer >= 1"),
    ("qwen3_moe", "hidden_act", "relu", r"hidden_act='relu' is not supported for MoE experts"),
])
def test_bad_config_fails_before_weights_are_read(name, field, value, match, tmp_root, tmp_path):
    _saved(name, tmp_root)
    cfg = json.loads(open(f"{tmp_root}/{name}/config.json").read())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")  # reading it would fail differently
    with pytest.raises(ValueError, match=match):
        build_model(open_model(str(tmp_path)), dtype="float32")


def test_llm_greedy_matches_hf(tiny_tokenizer, tmp_path):
    """Through LLM (scheduler, step graphs on CPU): decode steps replayed from a step graph with the compiled
    fused_moe, or run eagerly when the reference experts refuse capture, are exact either way."""
    pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")
    from pagellm import LLM, SamplingParams

    hf = make_tiny_hf(tf.MixtralConfig, tf.MixtralForCausalLM, seed=3, vocab_size=len(tiny_tokenizer),
                      num_local_experts=4, num_experts_per_tok=2)
    hf.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    prompts = random_prompts([5, 17, 30], len(tiny_tokenizer), seed=1)
    ref = hf_greedy_batch(hf, prompts, 16)
    llm = LLM(str(tmp_path), max_model_len=128, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_quantized_experts_refused_before_weights_are_read(tmp_root):
    """A weight format that would quantize the experts is refused at construction, naming it; dense MoE-model
    layers may be quantized, experts may not."""
    _saved("mixtral", tmp_root)
    with pytest.raises(ValueError, match=r"block_sparse_moe.experts: quantized MoE experts .*'int8'"):
        build_model(open_model(f"{tmp_root}/mixtral"), dtype="float32", quantization="int8")
