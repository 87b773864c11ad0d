"""Speculative verify steps through the greedy LM head (session 18): when every sampling row of a step is plain greedy,
the runner returns each logits row's argmax (linear_argmax over the 1 + k rows, no [rows, V] logits) and the engine
verifies chains and trees from those (spec_step._verify_from_argmax): no sampler call, and exactly the tokens of the
logits path (greedy head off) and of decoding without speculation."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.ops import linear_dispatch  # noqa: E402
from test_greedy_head import _counted  # noqa: E402

MAX_TOKENS = 24


def _prompts(vocab: int, num: int, seed: int) -> list[list[int]]:
    """A segment recurring with different continuations (ngram drafts, branching trees), and plain random prompts."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        seg = [rng.randrange(5, vocab) for _ in range(rng.randrange(2, 5))]
        body = []
        for _ in range(rng.randrange(3, 6)):
            body += seg + [rng.randrange(5, vocab) for _ in range(rng.randrange(1, 4))]
        prompts.append(body + seg if i % 3 else [rng.randrange(5, vocab) for _ in range(rng.randrange(4, 20))])
    return prompts


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.skipif(linear_dispatch._AMX_OK, reason="with AMX, 3-256 bf16 rows take AMX tiles: the head keeps logits")
@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "ngram", "num_speculative_tokens": 4, "tree_nodes": 9}],
                         ids=["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_verify_steps_use_the_fused_head(tiny_llama_dir, tiny_tokenizer, monkeypatch, spec, batch):
    prompts = _prompts(len(tiny_tokenizer), 6, seed=batch)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - 3 * (i % 2), ignore_eos=True)
              for i in range(len(prompts))]
    kw = dict(dtype="bfloat16", max_model_len=128, max_num_seqs=batch, seed=0)
    plain = _tokens(LLM(str(tiny_llama_dir), **kw), prompts, params)
    llm = LLM(str(tiny_llama_dir), speculative_config={**spec, "adaptive": False, "disable_by_batch_size": 64}, **kw)
    eng = llm.llm_engine
    fused = _counted(monkeypatch, eng.model, "compute_greedy_token_ids")
    sampler = _counted(monkeypatch, eng.sampler, "forward")
    verify = _counted(monkeypatch, eng.sampler, "verify")
    got = _tokens(llm, prompts, params)
    accepted = eng.spec_stats.num_accepted_draft_tokens
    assert accepted > 0 and eng.spec_stats.num_draft_tokens > accepted  # drafts accepted and rejected
    assert fused and not sampler and not verify  # every step through the fused head, verify steps included
    assert got == plain
    assert not eng.has_unfinished_requests()
    off = LLM(str(tiny_llama_dir), speculative_config={**spec, "adaptive": False, "disable_by_batch_size": 64}, **kw)
    off.llm_engine.greedy_head = False  # the logits path: the sampler verifies the same drafts
    verify_off = _counted(monkeypatch, off.llm_engine.sampler, "verify")
    assert _tokens(off, prompts, params) == plain and verify_off
    assert off.llm_engine.spec_stats.num_accepted_draft_tokens == accepted


@pytest.mark.parametrize("other", [dict(logprobs=1), dict(temperature=0.7, seed=5)])
def test_a_row_that_needs_logits_keeps_the_sampler_verify(tiny_llama_dir, tiny_tokenizer, monkeypatch, other):
    """One request that needs logits (logprobs, sampling) beside greedy ones: its steps verify through the sampler,
    with the same tokens as the greedy head off."""
    prompts = _prompts(len(tiny_tokenizer), 4, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **other})
    runs = []
    for greedy_head in (True, False):  # fresh engines (a second run on one engine hits the prefix cache)
        llm = LLM(str(tiny_llama_dir), dtype="bfloat16", max_model_len=128, max_num_seqs=4, seed=0,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
        llm.llm_engine.greedy_head = greedy_head
        verify = _counted(monkeypatch, llm.llm_engine.sampler, "verify")
        runs.append(_tokens(llm, prompts, params))
        assert verify and llm.llm_engine.spec_stats.num_draft_tokens > 0
    assert runs[0] == runs[1]
