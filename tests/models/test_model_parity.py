"""pagellm models vs transformers on the same tiny random weights (float32): prompt logprobs and greedy decoding
through a paged KV cache (random block assignment, block sizes 1/16/128, mixed prefill/decode batches)."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers as tf

from paged_model_utils import (
    available_backends, hf_greedy_batch, hf_prompt_logprobs, make_backend, make_tiny_hf, paged_greedy,
    paged_prompt_logprobs, random_prompts,
)
from pagellm.model_loader import build_model, open_model

LENGTHS = [1, 17, 45, 140]  # cross the 16- and 128-token block boundaries
NEW_TOKENS = 32
BLOCK_SIZES = [1, 16, 128]
# greedy decoding is slower: every block size for these cases, block size 16 for the rest
GREEDY_ALL_BLOCK_SIZES = {"llama", "mistral_sliding"}

CASES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(head_dim=16)),
    "llama_tied": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(head_dim=32, tie_word_embeddings=True, num_hidden_layers=3)),
    "llama3_rope": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
        head_dim=32, rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama_linear_rope": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
        rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=2.0))),
    "mistral_sliding": (tf.MistralConfig, tf.MistralForCausalLM, dict(head_dim=16, sliding_window=8)),
    "qwen2_bias": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(num_hidden_layers=3)),
    "qwen2_sliding": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=8,
                                                                max_window_layers=1)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=32, num_hidden_layers=2)),
}
BACKENDS = available_backends()


@functools.lru_cache(maxsize=None)
def _case(name: str, tmp_root: str):
    cfg_cls, model_cls, overrides = CASES[name]
    hf = make_tiny_hf(cfg_cls, model_cls, seed=len(name), **overrides)
    path = f"{tmp_root}/{name}"
    hf.save_pretrained(path)
    model = build_model(open_model(path), dtype="float32")
    prompts = random_prompts(LENGTHS, hf.config.vocab_size, seed=len(name))
    ref_lp = [hf_prompt_logprobs(hf, p) for p in prompts]
    ref_gen = hf_greedy_batch(hf, prompts, NEW_TOKENS)
    return hf, model, prompts, ref_lp, ref_gen


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("parity"))


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
        if bs != 16 and name not in GREEDY_ALL_BLOCK_SIZES:
            continue
        gen = paged_greedy(model, be, prompts, NEW_TOKENS, bs, seed=bs + 1)
        for i, (g, r) in enumerate(zip(gen, ref_gen)):
            assert g == r, f"{name}/{backend}/block {bs}: prompt {i} greedy differs\n{g}\n{r}"


def test_kv_cache_info(tmp_root):
    _, model, *_ = _case("mistral_sliding", tmp_root)
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 16)
    assert model.window_sizes == [8, 8]
    _, model, *_ = _case("qwen2_sliding", tmp_root)
    assert model.window_sizes == [-1, 8]  # Qwen2: only layers >= max_window_layers slide
    _, model, *_ = _case("qwen2_bias", tmp_root)
    assert model.window_sizes == [-1, -1, -1]
    _, model, *_ = _case("llama_tied", tmp_root)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.head_dim == 32


def test_decode_logprobs_match_hf(tmp_root):
    """Per-step decode logprobs along the greedy path vs HF's full forward on prompt + generated tokens."""
    hf, model, prompts, _, ref_gen = _case("qwen3", tmp_root)
    gen, lps = paged_greedy(model, make_backend(BACKENDS[0]), prompts[1:3], 8, 16, return_logprobs=True)
    for p, g, steps in zip(prompts[1:3], gen, lps):
        full = hf_prompt_logprobs(hf, p + g)
        for j, lp in enumerate(steps):
            assert (lp - full[len(p) - 1 + j]).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_bf16_close_to_hf(dtype, tmp_root):
    """bf16 serving of the float32 checkpoint stays close to HF bf16 (not bit-exact: op fusion differs)."""
    hf, _, prompts, _, _ = _case("llama", tmp_root)
    model = build_model(open_model(f"{tmp_root}/llama"), dtype=dtype)
    assert next(model.parameters()).dtype == torch.bfloat16
    hf16 = hf.to(torch.bfloat16)
    try:
        lps = paged_prompt_logprobs(model, make_backend(BACKENDS[0]), prompts[1:3], 16)
        for p, a in zip(prompts[1:3], lps):
            b = hf_prompt_logprobs(hf16, p)
            assert (a - b).abs().max().item() < 0.15
    finally:
        hf.float()
