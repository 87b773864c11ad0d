"""The engine's greedy LM head (LLMEngine.greedy_head, ops linear_argmax): plain-greedy steps take their tokens
from the head's fused argmax and give exactly the tokens, text and finish reasons of the logits + sampler path;
a step with any row that needs logits (logprobs, prompt logprobs, sampling) keeps the logits for every row."""

from __future__ import annotations

import pytest

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from pagellm import LLM, SamplingParams  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7], [250, 31, 64, 12, 8, 9, 10], [3, 4], [77] * 13]


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def llm(request, tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype=request.param, max_model_len=128, num_kv_blocks=256, seed=0)


def _counted(monkeypatch, obj, name: str) -> list[int]:
    """obj.name wrapped: the list gets one entry per call."""
    calls: list[int] = []
    real = getattr(obj, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, counting)
    return calls


def _run(llm: LLM, params: list[SamplingParams]):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.cumulative_logprob,
              None if c.logprobs is None else [sorted(d) for d in c.logprobs]) for c in o.outputs] for o in outs]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 20, "ignore_eos": True, **kw})


def test_plain_greedy_tokens_equal_the_sampler_path(llm, monkeypatch):
    eng = llm.llm_engine
    params = [_greedy(), _greedy(stop=["a"]), _greedy(max_tokens=7), _greedy()]
    fused_calls = _counted(monkeypatch, eng.model, "compute_greedy_token_ids")
    sampler_calls = _counted(monkeypatch, eng.sampler, "forward")
    fused = _run(llm, params)
    assert len(fused_calls) >= 19 and sampler_calls == []  # every step fused (the prefill's included)
    monkeypatch.setattr(eng, "greedy_head", False)
    general = _run(llm, params)
    assert len(sampler_calls) >= 19 and len(fused_calls) < 40
    assert fused == general
    assert all(len(c[0]) > 0 for o in fused for c in o)


@pytest.mark.parametrize("other,sampler_steps", [(dict(logprobs=2), 20), (dict(prompt_logprobs=1), 1),
                                                 (dict(temperature=0.8, seed=3), 20)])
def test_a_row_that_needs_logits_keeps_them_for_the_step(llm, monkeypatch, other, sampler_steps):
    """One request beside plain-greedy ones asks for logprobs / sampling (every step it is in computes logits and
    runs the sampler) or prompt logprobs (only the prefill step: its decode steps are plain greedy); the tokens
    are the same as with the greedy head off."""
    eng = llm.llm_engine
    kw = {"temperature": 0.0, **other}
    params = [_greedy(), SamplingParams(max_tokens=20, ignore_eos=True, **kw), _greedy(), _greedy(max_tokens=5)]
    sampler_calls = _counted(monkeypatch, eng.sampler, "forward")
    mixed = _run(llm, params)
    assert len(sampler_calls) == sampler_steps  # all four prefill in one step, then 19 decode steps
    monkeypatch.setattr(eng, "greedy_head", False)
    assert _run(llm, params) == mixed
