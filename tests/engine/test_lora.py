"""LoRA adapters (issue 19): PEFT adapters on the tiny Llama equal a merged-weights checkpoint (W + s * B A) run
by a fresh LLM, greedy tokens and logprobs; requests of different adapters (and none) batched together equal
each run alone, also with more adapters than max_loras; bad adapters and unknown names are refused and leave
the engine, its adapters and its weights as they were; loading an adapter again under its name replaces it."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_helpers import ALL_TARGETS, write_merged_checkpoint, write_peft_adapter
from pagellm import LLM, LoRARequest, SamplingParams

# the last prompt spans full KV blocks, so later runs of it hit the prefix cache: only those of the same adapter may
PROMPTS = ["hello world", "def main():", "the quick brown fox jumps over the lazy dog. " * 4]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)


def _llm(path: Path, **kw) -> LLM:
    return LLM(str(path), num_kv_blocks=96, max_model_len=128, **kw)


def _outputs(llm: LLM, prompts=PROMPTS, lora_request=None):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora_request)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def _assert_close(a, b, tol: float = 2e-4) -> None:
    for (tok_a, lp_a), (tok_b, lp_b) in zip(a, b, strict=True):
        assert tok_a == tok_b
        for da, db in zip(lp_a, lp_b):
            assert da.keys() == db.keys()
            for t in da:
                assert da[t] == pytest.approx(db[t], abs=tol)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "all": write_peft_adapter(root / "all", tiny_llama_dir, rank=8, alpha=16, targets=ALL_TARGETS, seed=1),
        "qv": write_peft_adapter(root / "qv", tiny_llama_dir, rank=4, alpha=8, targets=["q_proj", "v_proj"], seed=2,
                                 std=0.3),
        "mlp": write_peft_adapter(root / "mlp", tiny_llama_dir, rank=16, alpha=4, targets=["gate_proj", "down_proj"],
                                  seed=3, use_rslora=True),
        "big": write_peft_adapter(root / "big", tiny_llama_dir, rank=32, alpha=32, targets=["q_proj"], seed=4),
        "bogus": write_peft_adapter(root / "bogus", tiny_llama_dir, rank=4, alpha=4, targets=["q_proj"], seed=5),
    }


@pytest.fixture(scope="module")
def merged_outputs(tiny_llama_dir, adapters, tmp_path_factory) -> dict[str, list]:
    """Greedy outputs of a fresh LLM on each merged checkpoint (the reference), and of the base model."""
    refs = {"base": _outputs(_llm(tiny_llama_dir))}
    for name in ("all", "qv", "mlp"):
        merged = write_merged_checkpoint(tiny_llama_dir, adapters[name], tmp_path_factory.mktemp(f"m-{name}") / "m")
        refs[name] = _outputs(_llm(merged))
    return refs


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir, adapters) -> LLM:
    llm = _llm(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=4)
    for name in ("all", "qv", "mlp"):
        llm.load_lora(name, str(adapters[name]))
    return llm


def test_adapters_change_the_outputs(merged_outputs):
    for name in ("all", "qv", "mlp"):
        assert [t for t, _ in merged_outputs[name]] != [t for t, _ in merged_outputs["base"]], name


@pytest.mark.parametrize("name", ["all", "qv", "mlp"])
def test_lora_equals_merged_weights(lora_llm, merged_outputs, name):
    lr = LoRARequest(name, 1 + ["all", "qv", "mlp"].index(name))
    _assert_close(_outputs(lora_llm, lora_request=lr), merged_outputs[name])


def test_no_adapter_equals_base(lora_llm, merged_outputs):
    _assert_close(_outputs(lora_llm), merged_outputs["base"], tol=1e-5)


def test_prefix_cache_is_shared_within_an_adapter_only(lora_llm, merged_outputs):
    engine = lora_llm.llm_engine
    hits = engine.get_stats().prefix_cache_hits
    _assert_close(_outputs(lora_llm, lora_request=LoRARequest("qv", 2)), merged_outputs["qv"])
    assert engine.get_stats().prefix_cache_hits > hits  # the long prompt's blocks from the earlier "qv" run


def test_mixed_adapters_in_one_batch(lora_llm, merged_outputs):
    """Every prompt under every adapter and none, all in one generate call (max_loras=2 < 3 adapters: the
    third waits for a slot); the shared prompts must not share prefix-cache blocks across adapters."""
    names = [None, "all", "qv", "mlp"]
    prompts = [p for _ in names for p in PROMPTS]
    requests = [None if n is None else LoRARequest(n, 1 + i) for i, n in enumerate(names) for _ in PROMPTS]
    outs = _outputs(lora_llm, prompts, requests)
    for i, n in enumerate(names):
        _assert_close(outs[i * len(PROMPTS) : (i + 1) * len(PROMPTS)], merged_outputs[n or "base"])
    assert not lora_llm.llm_engine.lora.active and not lora_llm.llm_engine.lora.waiting


def test_at_most_max_loras_adapters_per_step(lora_llm):
    engine = lora_llm.llm_engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, name in enumerate(["all", "qv", "mlp", "all"]):
        engine.add_request(f"cap-{i}", "hello world", params, lora_request=LoRARequest(name, 1))
    seen = []
    while engine.has_unfinished_requests():
        assert len(engine.lora.active) <= 2
        seen.append(set(engine.lora.active))
        engine.step()
    assert {"all", "qv"} in seen and any("mlp" in s for s in seen)


def test_bad_adapters_are_refused_and_leave_the_engine_intact(lora_llm, adapters, merged_outputs, tmp_path):
    before = lora_llm.list_loras()
    with pytest.raises(ValueError, match="max_lora_rank"):
        lora_llm.load_lora("big", str(adapters["big"]))
    bogus = adapters["bogus"]
    cfg = (bogus / "adapter_config.json").read_text().replace('"q_proj"', '"nonexistent_proj"')
    (bogus / "adapter_config.json").write_text(cfg)
    with pytest.raises(ValueError, match="nonexistent_proj"):
        lora_llm.load_lora("all", str(bogus))  # a failed replacement keeps the old "all"
    with pytest.raises(ValueError, match="not a directory"):
        lora_llm.load_lora("x", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("nope", 9))
    with pytest.raises(ValueError, match="lora_requests for"):
        lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[None])
    assert lora_llm.list_loras() == before
    assert not lora_llm.llm_engine.has_unfinished_requests()
    _assert_close(_outputs(lora_llm, lora_request=LoRARequest("all", 1)), merged_outputs["all"])
    _assert_close(_outputs(lora_llm), merged_outputs["base"], tol=1e-5)


def test_reload_replaces_an_adapter_in_place(tiny_llama_dir, adapters, merged_outputs):
    llm = _llm(tiny_llama_dir, enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=2)
    llm.load_lora("a", str(adapters["qv"]))
    _assert_close(_outputs(llm, lora_request=LoRARequest("a", 1)), merged_outputs["qv"])
    llm.load_lora("a", str(adapters["mlp"]))  # same name, new weights: the slot is rewritten, old cache unused
    _assert_close(_outputs(llm, lora_request=LoRARequest("a", 1)), merged_outputs["mlp"])
    # a request may name an adapter by path: loaded on first use
    _assert_close(_outputs(llm, lora_request=LoRARequest("b", 2, str(adapters["all"]))), merged_outputs["all"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        llm.load_lora("c", str(adapters["qv"]))
    llm.remove_lora("b")
    assert llm.list_loras() == ["a"]


def test_lora_config_is_validated(tiny_llama_dir):
    from pagellm import EngineArgs

    for bad in ({"max_loras": 0}, {"max_lora_rank": 0}, {"max_loras": 4, "max_cpu_loras": 2}, {"max_loras": True}):
        with pytest.raises(ValueError):
            EngineArgs(model=str(tiny_llama_dir), enable_lora=True, **bad)
    llm = _llm(tiny_llama_dir)
    with pytest.raises(ValueError, match="not enabled"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1))
    with pytest.raises(ValueError, match="not enabled"):
        llm.load_lora("a", "/nonexistent")


@pytest.mark.parametrize("name", ["all", "mlp"])
def test_lora_equals_hf_peft(lora_llm, tiny_llama_dir, adapters, name):
    """The same adapter through HF PEFT on transformers (fp32): our greedy tokens are its argmax and our
    logprobs its log-softmax at every generated position."""
    peft = pytest.importorskip("peft", reason="HF PEFT is an optional test dependency")
    import torch
    from transformers import AutoModelForCausalLM

    hf = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)),
                                        str(adapters[name])).eval()
    outs = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest(name, 1))
    for out in outs:
        prompt, gen = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1 : -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        assert logits.argmax(-1).tolist() == gen
        ours = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, gen)]
        assert ours == pytest.approx(logprobs[torch.arange(len(gen)), gen].tolist(), abs=2e-4)
