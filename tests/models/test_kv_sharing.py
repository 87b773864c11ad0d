"""Cross-layer KV sharing (`kv_sharing_layers` / `num_kv_shared_layers` on a Llama config) against a plain-torch
reference forward written here: full causal attention, each sharing layer attending over the keys and values its
target layer computed (rotated K, V), with its own q_proj / o_proj and MLP.

The checkpoint is transformers' LlamaForCausalLM weights minus the sharing layers' k_proj / v_proj.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.kv_cache import FullAttentionSpec, SharedKVSpec
from pagellm.models.kv_sharing import resolve_kv_sharing
from pagellm.ops import ops_available
from scheduler_probes import CountingScheduler
from tiny_models import write_tiny_llama

SHARING = {2: 0, 3: 1}  # 4 layers: 2 own their cache, 2 read it
NUM_LAYERS, HIDDEN, HEADS, KV_HEADS = 4, 64, 4, 2
HEAD_DIM = HIDDEN // HEADS
NEW_TOKENS = 32


def _write_shared_llama(path: Path, tokenizer, config_extra: dict) -> Path:
    write_tiny_llama(path, tokenizer, hidden_size=HIDDEN, num_layers=NUM_LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_token_id]}))
    config = json.loads((path / "config.json").read_text())
    config.update(config_extra)
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(path / "model.safetensors")
    dropped = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in SHARING for p in "kv"]
    save_file({k: v.contiguous() for k, v in weights.items() if k not in dropped}, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def shared_llama(tmp_path_factory, tiny_tokenizer):
    return _write_shared_llama(tmp_path_factory.mktemp("shared-llama"), tiny_tokenizer,
                               {"kv_sharing_layers": {str(k): v for k, v in SHARING.items()}})


# ---------------------------------------------------------------- the plain-torch reference
def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated (HF's rotate_half convention, theta 10000)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


def reference_logits(w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """[T, vocab] logits of the whole sequence, every layer in plain torch."""
    T = len(ids)
    pos = torch.arange(T)
    h = w["model.embed_tokens.weight"][torch.tensor(ids)]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"])
        q = _rope((x @ w[p + "self_attn.q_proj.weight"].T).view(T, HEADS, HEAD_DIM), pos)
        if i in SHARING:
            k, v = kv[SHARING[i]]
        else:
            k = _rope((x @ w[p + "self_attn.k_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM), pos)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
            kv[i] = (k, v)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        s = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
        attn = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)
        h = h + attn.reshape(T, HIDDEN) @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"])
        h = h + (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ \
            w[p + "mlp.down_proj.weight"].T
    return _rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


# ---------------------------------------------------------------- engine vs reference
def _prompts(vocab: int, lengths) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


def _check_against_reference(path: Path, prompts, outs) -> None:
    """Prompt logprobs, and greedy decoding checked by teacher forcing: one reference forward over prompt +
    generated tokens, whose argmax at every step must be the engine's token (so the sequences are equal)."""
    w = load_file(path / "model.safetensors")
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        assert len(got.token_ids) == NEW_TOKENS
        lp = reference_logits(w, prompt + list(got.token_ids)).log_softmax(-1)
        for t in range(1, len(prompt)):
            assert out.prompt_logprobs[t][prompt[t]].logprob == pytest.approx(float(lp[t - 1, prompt[t]]), abs=1e-4)
        for step, tok in enumerate(got.token_ids):
            row = lp[len(prompt) - 1 + step]
            assert tok == int(row.argmax()), f"step {step}"
            assert got.logprobs[step][tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)


BACKENDS = ["torch"] + (["cpu"] if ops_available()[0] else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logprobs_and_greedy_tokens_match_the_reference(shared_llama, tiny_tokenizer, backend):
    prompts = _prompts(len(tiny_tokenizer), [5, 23, 40])
    llm = LLM(str(shared_llama), attention_backend=backend, num_kv_blocks=64, block_size=16, max_model_len=256)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False, logprobs=1,
                        prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    _check_against_reference(shared_llama, prompts, outs)
    if backend == "cpu":  # decode steps replayed from captured step graphs (skipped K/V writes included)
        assert llm.llm_engine.runner.step_graphs.num_replays > 0
    model = llm.llm_engine.model
    attn = {s.layer_idx: s.kv_source_layer for s in model.attention_specs()}
    assert attn == {0: -1, 1: -1, 2: 0, 3: 1}
    assert not hasattr(model.model.layers[2].self_attn, "qkv_proj")  # q_proj only


def test_shared_layers_allocate_no_pages(shared_llama, tiny_tokenizer):
    llm = LLM(str(shared_llama), kv_cache_memory_gb=0.001, block_size=16, max_model_len=128)
    eng = llm.llm_engine
    cfg = eng.kv_cache_config
    specs = eng.model.kv_cache_specs(16, torch.float32)
    assert specs[2] == SharedKVSpec(0) and specs[3] == SharedKVSpec(1)
    page = FullAttentionSpec(16, KV_HEADS, HEAD_DIM, torch.float32).page_size_bytes  # one layer's K + V page
    owners = NUM_LAYERS - len(SHARING)
    assert cfg.bytes_per_block == owners * page  # NUM_LAYERS * page without sharing
    assert cfg.bytes_per_token == owners * 2 * KV_HEADS * HEAD_DIM * 4
    assert cfg.num_blocks == int(0.001 * (1 << 30)) // (owners * page)
    caches = eng.kv_caches
    assert len(list(caches.tensors())) == 2 * owners
    assert caches[2] is caches[0] and caches[3] is caches[1]


def test_prefix_caching_and_preemption_match_the_reference(shared_llama, tiny_tokenizer):
    """Few blocks: requests are preempted and recomputed; shared prefixes hit the prefix cache."""
    base = _prompts(len(tiny_tokenizer), [24])[0]
    prompts = [base + p for p in _prompts(len(tiny_tokenizer), [3, 9, 17, 26])] + [base]
    llm = LLM(str(shared_llama), num_kv_blocks=24, block_size=4, max_model_len=88, enable_prefix_caching=True)
    eng = llm.llm_engine
    eng.scheduler = counting = CountingScheduler(eng.scheduler)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False, logprobs=1,
                        prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    _check_against_reference(shared_llama, prompts, outs)
    assert counting.num_preempted > 0
    assert eng.scheduler.prefix_cache_hits > 0
    assert eng.num_free_blocks == eng.scheduler.num_blocks


# ---------------------------------------------------------------- configuration
def test_num_kv_shared_layers_follows_gemma3n():
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=6, num_kv_shared_layers=3)
    kinds = ["slide", "full", "slide", "full", "slide", "full"]
    assert resolve_kv_sharing(cfg, 6, lambda i: kinds[i]) == {3: 1, 4: 2, 5: 1}
    assert resolve_kv_sharing(LlamaConfig(num_hidden_layers=4), 4, lambda i: 0) == {}
    with pytest.raises(ValueError, match="num_kv_shared_layers=2: layer 3 has no earlier non-shared layer"):
        resolve_kv_sharing(LlamaConfig(num_kv_shared_layers=2), 4, lambda i: i == 3)


@pytest.mark.parametrize("extra, message", [
    ({"kv_sharing_layers": {"1": 2}}, r"kv_sharing_layers: layer 1 shares the cache of layer 2, which is not an "
                                      r"earlier layer"),
    ({"kv_sharing_layers": {"1": 1}}, r"kv_sharing_layers: layer 1 .* not an earlier layer"),
    ({"kv_sharing_layers": {"2": 1, "1": 0}}, r"kv_sharing_layers: layer 2 .* layer 1, which is itself shared"),
    ({"kv_sharing_layers": {"9": 0}}, r"kv_sharing_layers: a sharing layer must be a layer index in \[0, 4\)"),
    ({"kv_sharing_layers": {"3": "x"}}, r"kv_sharing_layers: the target of layer 3"),
    ({"kv_sharing_layers": [3, 1]}, r"kv_sharing_layers must be a mapping"),
    ({"kv_sharing_layers": {"2": 1}, "sliding_window": 8,
      "layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]},
     r"kv_sharing_layers: layer 2 \(\(2, 16, -1\)\) cannot share the cache of layer 1 \(\(2, 16, 8\)\)"),
    ({"kv_sharing_layers": {"2": 0}, "num_kv_shared_layers": 1}, r"set one of kv_sharing_layers and"),
    ({"num_kv_shared_layers": 4}, r"num_kv_shared_layers must be an integer in \[0, 4\)"),
])
def test_bad_maps_raise_before_weights_are_read(tmp_path, tiny_tokenizer, extra, message):
    path = _write_shared_llama(tmp_path / "m", tiny_tokenizer, extra)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")  # reading it would fail differently
    with pytest.raises(ValueError, match=message):
        LLM(str(path), num_kv_blocks=16, block_size=16, max_model_len=64)


def test_engine_logs_kv_bytes_per_token_at_start_up(shared_llama, caplog):
    import logging

    log = logging.getLogger("pagellm")  # does not propagate to the root logger caplog listens on
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="pagellm"):
            llm = LLM(str(shared_llama), num_kv_blocks=16, block_size=16, max_model_len=64)
    finally:
        log.removeHandler(caplog.handler)
    per_token = (NUM_LAYERS - len(SHARING)) * 2 * KV_HEADS * HEAD_DIM * 4  # K + V rows of the owners, float32
    assert llm.llm_engine.kv_cache_bytes_per_token == per_token
    assert llm.llm_engine.get_stats().kv_cache_bytes_per_token == per_token
    assert f"KV cache: {per_token} bytes per token (layers: 2 full, 0 sliding, 0 MLA, 2 shared)" in caplog.text


@pytest.mark.parametrize("arch", ["Qwen2", "Qwen3"])
def test_qwen_sharing_layers_expect_hf_names_minus_k_and_v(arch):
    """Qwen2 (q/k/v bias) and Qwen3 (q_norm / k_norm): a sharing layer expects q_proj (+ bias) and q_norm only."""
    import transformers

    from pagellm.models.registry import get_model_cls

    cfg = getattr(transformers, f"{arch}Config")(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, tie_word_embeddings=False)
    hf_names = set(getattr(transformers, f"{arch}ForCausalLM")(cfg).state_dict())
    cfg.kv_sharing_layers = {str(k): v for k, v in SHARING.items()}
    model = get_model_cls(f"{arch}ForCausalLM")(cfg)
    shared_kv = {n for n in hf_names for i in SHARING
                 if n.startswith(f"model.layers.{i}.self_attn.") and n.split(".")[4] in ("k_proj", "v_proj", "k_norm")}
    assert shared_kv  # the names a sharing layer's checkpoint lacks
    assert model.expected_weight_names() == hf_names - shared_kv
    assert model.kv_cache_specs(16, torch.float32)[3] == SharedKVSpec(1)
