"""Gemma 2 / Gemma 3 (text) vs transformers on tiny random weights written here: float32 prompt logprobs and
32 greedy tokens through the paged cache (prompts far longer than the sliding window, windows that end inside
a block), the engine with prefix caching and forced preemption, batch invariance, bf16, and bad configs."""

from __future__ import annotations

import copy
import functools
import json
import random

import pytest
import torch
import transformers as tf

from paged_model_utils import (
    available_backends, hf_greedy_batch, hf_prompt_logprobs, make_backend, make_tiny_hf, paged_greedy,
    paged_prompt_logprobs, random_prompts,
)
from pagellm.kv_cache import group_kv_cache_specs
from pagellm.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from pagellm.model_loader import build_model, open_model
from pagellm.models.gemma2 import Gemma2ForCausalLM
from pagellm.models.gemma3 import Gemma3ForCausalLM
from scheduler_probes import CountingScheduler

S, F = "sliding_attention", "full_attention"
LENGTHS = [1, 9, 30, 70]  # 30 and 70: many windows long, crossing block boundaries
NEW_TOKENS = 32
BLOCK_SIZES = [1, 4, 16]
GEMMA3_ROPE = {S: {"rope_type": "default", "rope_theta": 10000.0},
               F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}
CASES = {
    # Gemma 2: both soft-caps on (they change the logprobs by ~1 at these weights), tied embeddings
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(
        head_dim=16, num_hidden_layers=3, sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=4.0, tie_word_embeddings=True)),
    # Gemma 3: q/k norms, a local rope base for sliding layers and a scaled global one, untied head;
    # attn_logit_softcapping set but (as in HF's Gemma 3 attention) not applied
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(
        head_dim=16, num_hidden_layers=3, sliding_window=7, query_pre_attn_scalar=24, layer_types=[S, F, S],
        rope_parameters=GEMMA3_ROPE, attn_logit_softcapping=5.0, final_logit_softcapping=6.0,
        tie_word_embeddings=False)),
}
BACKENDS = available_backends()


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gemma"))


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_prompt_logprobs_and_greedy_match_hf(name, backend, tmp_root):
    hf, model, prompts, ref_lp, ref_gen = _case(name, tmp_root)
    be = make_backend(backend)
    for bs in BLOCK_SIZES:
        for p, a, b in zip(prompts, paged_prompt_logprobs(model, be, prompts, bs, seed=bs), ref_lp):
            err = (a - b).abs().max().item()
            assert err < 1e-4, f"{name}/{backend}/block {bs}: prompt len {len(p)} max |dlogprob| {err}"
    gen = paged_greedy(model, be, prompts, NEW_TOKENS, 4, seed=5)
    for i, (g, r) in enumerate(zip(gen, ref_gen)):
        assert g == r, f"{name}/{backend}: prompt {i} greedy differs\n{g}\n{r}"


def test_model_structure(tmp_root):
    """Interleaved windows, one spec per layer (one page shape; a hybrid cache splits sliding from full), tied
    head, 1 + w norms."""
    hf, model, *_ = _case("gemma2", tmp_root)
    assert model.window_sizes == [6, -1, 6]
    specs = model.kv_cache_specs(16, torch.float32)
    assert [type(specs[i]) for i in range(3)] == [SlidingWindowSpec, FullAttentionSpec, SlidingWindowSpec]
    assert len(group_kv_cache_specs(specs)) == 1  # same page shape: one group when the window is a mask
    hybrid = group_kv_cache_specs(specs, split_windows=True)  # the engine's: the sliding layers free their blocks
    assert [(g.layer_ids, g.sliding_window) for g in hybrid] == [((0, 2), 6), ((1,), 0)]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hf_w = hf.model.layers[0].pre_feedforward_layernorm.weight
    assert torch.equal(model.model.layers[0].pre_feedforward_layernorm.weight, 1.0 + hf_w.float())
    _, model3, *_ = _case("gemma3", tmp_root)
    assert model3.window_sizes == [7, -1, 7] and model3.lm_head.weight is not model3.model.embed_tokens.weight
    thetas = [layer.self_attn.rotary_emb.rope_parameters["rope_theta"] for layer in model3.model.layers]
    assert thetas == [10000.0, 1000000.0, 10000.0]


def test_gemma3_flat_rope_parameters_use_the_local_base_for_sliding_layers():
    """A config without per-layer-type rope dicts: global layers read rope_parameters, sliding ones
    rope_local_base_freq (the pre-5.x fields)."""
    cfg = _tiny_cfg(tf.Gemma3TextConfig, layer_types=[S, F])
    cfg.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    cfg.rope_local_base_freq = 20000.0
    ropes = [layer.self_attn.rotary_emb for layer in Gemma3ForCausalLM(cfg).model.layers]
    assert [(r.rope_parameters["rope_type"], r.rope_parameters["rope_theta"]) for r in ropes] == [
        ("default", 20000.0), ("linear", 500000.0)]
    half = ropes[0].rotary_dim // 2
    inv_freq = 1.0 / (20000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    torch.testing.assert_close(ropes[0].cos_sin_cache[3, :half], torch.cos(3 * inv_freq))


def test_reloading_weights_in_place_keeps_results(tmp_root):
    """The norm loader adds 1 to what it is given, not to what the parameter holds: a reload is idempotent."""
    hf, model, prompts, ref_lp, _ = _case("gemma3", tmp_root)
    model.load_weights((n, t.detach().clone()) for n, t in hf.state_dict().items())
    lp = paged_prompt_logprobs(model, make_backend(BACKENDS[0]), prompts[2:3], 16)[0]
    assert (lp - ref_lp[2]).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_close_to_hf(name, tmp_root):
    """bf16 serving of the float32 checkpoint is about as far from the float32 logprobs as HF bf16 is (not
    bit-exact: the ops round the normalized x before the 1 + w product, HF after; the 1 + w norms and the
    q/k norms make these random weights sensitive to rounding, so HF bf16 itself is off by up to ~0.5)."""
    hf, _, prompts, ref_lp, _ = _case(name, tmp_root)
    model = build_model(open_model(f"{tmp_root}/{name}"), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)  # a copy: rounding hf itself would change the other tests' model
    lps = paged_prompt_logprobs(model, make_backend(BACKENDS[0]), prompts[1:3], 16)
    for p, a, ref in zip(prompts[1:3], lps, ref_lp[1:3]):
        hf_err = (hf_prompt_logprobs(hf16, p) - ref).abs().max().item()
        err = (a - ref).abs().max().item()
        assert err < 1.5 * hf_err + 0.05, f"prompt len {len(p)}: bf16 error {err}, HF bf16's {hf_err}"


# ---------------------------------------------------------------------------------------------- bad configs
def _write_config(path, cfg) -> None:
    """config.json + a corrupt weights file: an error raised before weights are read is the config's."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(cfg.to_json_string())
    (path / "model.safetensors").write_bytes(b"not a safetensors file")


@pytest.mark.parametrize("cfg_cls,arch,rope,field", [
    (tf.Gemma2Config, "Gemma2ForCausalLM", {"rope_type": "bogus", "rope_theta": 10000.0}, "rope_parameters"),
    (tf.Gemma3TextConfig, "Gemma3ForCausalLM", {S: {"rope_type": "bogus", "rope_theta": 1e4}, F: GEMMA3_ROPE[F]},
     "rope_parameters['sliding_attention']"),
])
def test_unknown_rope_type_refused_before_weights(tmp_path, cfg_cls, arch, rope, field):
    cfg = cfg_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, sliding_window=4, rope_parameters=rope, architectures=[arch])
    _write_config(tmp_path, cfg)
    with pytest.raises(ValueError, match=r"config\." + field.replace("[", r"\[").replace("]", r"\]") + ".*bogus"):
        build_model(open_model(tmp_path), dtype="float32")


def _tiny_cfg(cfg_cls, **kw):
    return cfg_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, sliding_window=4, **kw)


@pytest.mark.parametrize("model_cls,cfg_cls", [(Gemma2ForCausalLM, tf.Gemma2Config),
                                               (Gemma3ForCausalLM, tf.Gemma3TextConfig)])
@pytest.mark.parametrize("field,value,match", [
    ("layer_types", [S], "layer_types has 1 entries, but num_hidden_layers is 2"),
    ("layer_types", [S, "chunked_attention"], r"layer_types: unknown layer type\(s\) \['chunked_attention'\]"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("query_pre_attn_scalar", 0, "query_pre_attn_scalar must be > 0"),
    ("final_logit_softcapping", -1.0, "final_logit_softcapping must be > 0"),
])
def test_bad_config_values(model_cls, cfg_cls, field, value, match):
    cfg = _tiny_cfg(cfg_cls)
    setattr(cfg, field, value)  # after construction: HF's own checks would catch some of these first
    with pytest.raises(ValueError, match=match):
        model_cls(cfg)


# ---------------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, tiny_tokenizer):
    """A Gemma 2 checkpoint with the tiny tokenizer (window 6, block size 4 below: windows end mid-block)."""
    _, _, overrides = CASES["gemma2"]
    hf = make_tiny_hf(tf.Gemma2Config, tf.Gemma2ForCausalLM, seed=3, **{**overrides, "vocab_size": len(tiny_tokenizer)})
    path = tmp_path_factory.mktemp("gemma2-engine")
    hf.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tiny_tokenizer.eos_token_id]}))
    return path, hf


@pytest.fixture(scope="module")
def shared_prefix_reference(gemma_dir):
    """Prompts sharing a 22-token prefix (several windows long) and HF's greedy tokens for them."""
    _, hf = gemma_dir
    rng = random.Random(11)
    shared = [rng.randrange(5, hf.config.vocab_size) for _ in range(22)]
    prompts = [shared + [rng.randrange(5, hf.config.vocab_size) for _ in range(n)] for n in (1, 3, 7, 12, 17, 25)]
    return prompts, hf_greedy_batch(hf, prompts, NEW_TOKENS)


def _greedy(n=NEW_TOKENS):
    from pagellm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _llm(path, **kw):
    pytest.importorskip("pagellm._C", reason="the engine needs the C++ extension (make install)")
    from pagellm import LLM

    kw.setdefault("max_model_len", 128)
    return LLM(str(path), seed=0, **kw)


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prefill", "chunked-prefill"])
def test_engine_prefix_cache_and_preemption_match_hf(gemma_dir, shared_prefix_reference, chunk):
    """A sliding-window model with prefix caching and a KV cache too small for the batch (preemption by
    recompute, cached prefixes reused on resume), prompts prefilled whole or in chunks of 8 (windows spanning
    the cached context and the chunk), gives HF's greedy tokens."""
    path, hf = gemma_dir
    prompts, expected = shared_prefix_reference
    llm = _llm(path, block_size=4, num_kv_blocks=40, enable_prefix_caching=True, max_num_batched_tokens=chunk)
    eng = llm.llm_engine
    warm = llm.generate({"prompt_token_ids": prompts[0]}, _greedy(), use_tqdm=False)[0]
    assert warm.outputs[0].token_ids == expected[0]
    eng.scheduler = counter = CountingScheduler(eng.scheduler)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert counter.num_preempted > 0
    assert outs[0].num_cached_tokens >= 20 and eng.scheduler.prefix_cache_hits > 0
    # a hybrid cache: the sliding group's null block is never a request's
    assert eng.scheduler.num_kv_cache_groups == 2
    assert not eng.has_unfinished_requests() and eng.num_free_blocks == eng.scheduler.num_blocks - 1


def test_engine_batch_invariance(gemma_dir):
    """A request's greedy and seeded tokens do not depend on what else is in the batch."""
    from pagellm import SamplingParams

    path, hf = gemma_dir
    vocab = hf.config.vocab_size
    rng = random.Random(5)
    target = [rng.randrange(5, vocab) for _ in range(29)]
    others = [[rng.randrange(5, vocab) for _ in range(rng.randrange(2, 40))] for _ in range(9)]
    llm = _llm(path)
    alone = llm.generate({"prompt_token_ids": target}, _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert alone == hf_greedy_batch(hf, [target], NEW_TOKENS)[0]
    batch = others[:4] + [target] + others[4:]
    params = [SamplingParams(temperature=0.8, max_tokens=rng.randrange(2, 24), ignore_eos=True) for _ in batch]
    params[4] = _greedy()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert outs[4].outputs[0].token_ids == alone
    seeded = SamplingParams(n=2, temperature=1.0, top_p=0.95, seed=42, max_tokens=16, ignore_eos=True)
    one = [o.token_ids for o in llm.generate({"prompt_token_ids": target}, seeded, use_tqdm=False)[0].outputs]
    params[4] = seeded
    mixed = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)[4]
    assert [o.token_ids for o in mixed.outputs] == one


def test_engine_bf16_prompt_logprobs_close_to_hf(gemma_dir):
    """bf16 end to end through the engine: the prompt tokens' logprobs are about as far from float32 HF's as
    HF bf16's are (see test_bf16_close_to_hf)."""
    from pagellm import SamplingParams

    path, hf = gemma_dir
    prompt = random_prompts([40], hf.config.vocab_size, seed=9)[0]
    llm = _llm(path, dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    targets = torch.tensor(prompt[1:])
    ref = hf_prompt_logprobs(hf, prompt)[:-1].gather(1, targets[:, None])[:, 0]
    ref16 = hf_prompt_logprobs(copy.deepcopy(hf).to(torch.bfloat16), prompt)[:-1].gather(1, targets[:, None])[:, 0]
    got = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
    err, hf_err = (got - ref).abs().max().item(), (ref16 - ref).abs().max().item()
    assert err < 1.5 * hf_err + 0.05, f"bf16 error {err}, HF bf16's {hf_err}"
