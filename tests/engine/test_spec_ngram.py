"""The `ngram` (prompt lookup) proposer and `speculative_config`: the matcher against a plain-Python
reference, outputs equal to plain decoding on a tiny random Llama (fp32), the batch-size off-switch, a
raising proposer, the metrics (per request, engine-wide, Prometheus), bad configs, the CLI flag."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.config import EngineArgs  # noqa: E402
from pagellm.engine.stats import EngineStats  # noqa: E402
from pagellm.spec_decode import DraftRequest, SpecDecodeStats, SpeculativeConfig  # noqa: E402
from pagellm.spec_decode.ngram import NgramProposer, find_ngram_continuation  # noqa: E402
from scheduler_probes import CountingScheduler  # noqa: E402
from test_draft_tokens import (  # noqa: E402
    MIN_MARGIN,
    _assert_all_blocks_free,
    _generate,
    _greedy,
    _make_llm,
)

MAX_TOKENS = 40


def _ngram(k=4, **kw):
    return {"method": "ngram", "num_speculative_tokens": k, **kw}


# ---------------------------------------------------------------- the matcher vs a plain-Python reference


def _reference_continuation(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition: longest suffix n in [max_n..min_n] with an earlier occurrence (ending before the
    last token); the most recent such occurrence; the k tokens after it, read on from the start of that
    continuation whenever it reaches the end of the sequence."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                drafts, cont = [], tokens[start + n :]
                while len(drafts) < k:
                    drafts += cont[: k - len(drafts)]
                return drafts
    return []


@pytest.mark.parametrize("vocab", [2, 3, 7, 50])
def test_matcher_equals_reference_on_random_arrays(vocab):
    rng = random.Random(vocab)
    for _ in range(400):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        lo = rng.randrange(1, 5)
        hi = rng.randrange(lo, 9)
        k = rng.randrange(1, 7)
        got = find_ngram_continuation(np.asarray(tokens, dtype=np.int64), lo, hi, k).tolist()
        assert got == _reference_continuation(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_matcher_prefers_longest_then_most_recent():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 2, 3, 8, 5, 1, 2, 3]
    # suffix (1, 2, 3) occurred at 0..2 -> next tokens 9, 2; a shorter (2, 3) occurs later at 4..5 (-> 8)
    assert find_ngram_continuation(np.asarray(tokens), 1, 4, 2).tolist() == [9, 2]
    # with max 2 the most recent (2, 3) wins; its continuation reaches the end and repeats
    assert find_ngram_continuation(np.asarray(tokens), 1, 2, 3).tolist() == [8, 5, 1]
    assert find_ngram_continuation(np.asarray(tokens), 1, 2, 8).tolist() == [8, 5, 1, 2, 3, 8, 5, 1]
    # min above any match length: nothing
    assert find_ngram_continuation(np.asarray(tokens), 4, 4, 3).tolist() == []
    assert find_ngram_continuation(np.asarray([7]), 1, 4, 3).tolist() == []


def test_proposer_respects_room_and_skips_unmatched():
    proposer = NgramProposer(3, prompt_lookup_min=2, prompt_lookup_max=3)
    reqs = [DraftRequest("a", [5, 6, 7, 8, 9], [5, 6], max_num_drafts=2),  # (5, 6) -> 7, 8 (room 2)
            DraftRequest("b", [1, 2, 3], [4], max_num_drafts=3),  # no repeat: no entry
            DraftRequest("c", [4, 4, 4, 4], [4], max_num_drafts=3)]  # a loop: k drafts
    assert proposer.propose(reqs) == {"a": [7, 8], "c": [4, 4, 4]}


# ---------------------------------------------------------------- bad configs, the CLI flag


@pytest.mark.parametrize("config, match", [
    (_ngram(0), "num_speculative_tokens"),
    (_ngram(-2), "num_speculative_tokens"),
    (_ngram(257), "num_speculative_tokens"),
    (_ngram(2.0), "num_speculative_tokens"),
    ({"method": "nope", "num_speculative_tokens": 2}, "unknown method"),
    ({"num_speculative_tokens": 2}, "unknown method"),
    (_ngram(2, lookahead=3), "unknown keys"),
    (_ngram(2, prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
    (_ngram(2, prompt_lookup_min=0), "prompt_lookup_min"),
    (_ngram(2, prompt_lookup_max=1000), "prompt_lookup_max"),
    (_ngram(2, disable_by_batch_size=0), "disable_by_batch_size"),
])
def test_bad_speculative_configs_raise_before_loading(tiny_llama_dir, config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(config)
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(tiny_llama_dir), speculative_config=config)
    with pytest.raises(ValueError, match=match):
        LLM("/nonexistent/model/dir", speculative_config=config)  # refused before the model is opened
    with pytest.raises(TypeError):
        SpeculativeConfig.from_dict([("method", "ngram")])


def test_cli_parses_speculative_config(capsys):
    from pagellm.entrypoints.cli import build_parser

    parser = build_parser()
    flag = json.dumps(_ngram(4, prompt_lookup_max=3))
    args = parser.parse_args(["generate", "hi", "--speculative-config", flag])
    assert args.speculative_config == _ngram(4, prompt_lookup_max=3)
    assert parser.parse_args(["generate", "hi"]).speculative_config is None
    served = parser.parse_args(["serve", "--speculative-config", flag])
    from pagellm.entrypoints.serve import engine_kwargs

    assert engine_kwargs(served)["speculative_config"] == _ngram(4, prompt_lookup_max=3)
    for bad in ["{not json", json.dumps(_ngram(0)), json.dumps({"method": "nope", "num_speculative_tokens": 2})]:
        with pytest.raises(SystemExit):
            parser.parse_args(["generate", "hi", "--speculative-config", bad])
        assert "invalid speculative config" in capsys.readouterr().err


def test_cli_generate_with_ngram(tiny_llama_dir, capsys):
    from pagellm.entrypoints.cli import main

    rc = main(["generate", "hello hello hello", "--model", str(tiny_llama_dir), "--max-tokens", "24",
               "--temperature", "0", "--ignore-eos", "--no-chat-template", "--max-model-len", "128",
               "--speculative-config", json.dumps(_ngram(3))])
    err = capsys.readouterr().err
    assert rc == 0 and "output 24 tokens" in err


# ---------------------------------------------------------------- end to end on the tiny model


def _repetitive_prompts(vocab: int, num: int, seed: int) -> list[list[int]]:
    """Copy-heavy prompts (a random segment repeated) mixed with plain random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        if i % 4 == 3:
            prompts.append([rng.randrange(5, vocab) for _ in range(rng.randrange(4, 30))])
            continue
        seg = [rng.randrange(5, vocab) for _ in range(rng.randrange(3, 8))]
        prompts.append([rng.randrange(5, vocab) for _ in range(rng.randrange(0, 5))] + seg * 3 + seg[:2])
    return prompts


def _tie_free(path, vocab, params, num, seed=0, **kw) -> list[list[int]]:
    """`num` prompts whose plain continuation never has a top-2 gap below MIN_MARGIN (plain and spec
    runs compute a position through different kernels: only near-ties could flip)."""
    probe = params.clone()
    probe.logprobs, probe.logprobs_mode = 2, "processed"
    candidates = _repetitive_prompts(vocab, 3 * num, seed)
    outs = _generate(_make_llm(path, **kw), candidates, probe)
    chosen = []
    for prompt, out in zip(candidates, outs):
        gaps = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in out.logprobs]
        if min(g[0] - g[1] for g in gaps) > MIN_MARGIN:
            chosen.append(prompt)
    assert len(chosen) >= num, "not enough tie-free prompts"
    return chosen[:num]


@pytest.fixture(scope="module")
def vocab(tiny_tokenizer):
    return len(tiny_tokenizer)


def _check_metrics(eng, outs) -> None:
    """Per-request spec metrics sum to the engine's; rates follow from the counts."""
    stats = eng.spec_stats
    per_request = [o.metrics.spec_decode for o in outs if o.metrics.spec_decode is not None]
    assert sum(m.num_draft_tokens for m in per_request) == stats.num_draft_tokens
    assert sum(m.num_accepted_draft_tokens for m in per_request) == stats.num_accepted_draft_tokens
    assert sum(m.num_spec_rows for m in per_request) == stats.num_spec_rows
    assert stats.num_drafts_per_position[0] == stats.num_spec_rows
    assert sum(stats.num_drafts_per_position) == stats.num_draft_tokens
    assert sum(stats.num_accepted_per_position) == stats.num_accepted_draft_tokens
    rates = stats.acceptance_rate_per_position
    assert all(0.0 <= r <= 1.0 for r in rates) and len(rates) <= 4
    assert stats.acceptance_rate == pytest.approx(stats.num_accepted_draft_tokens / stats.num_draft_tokens)
    assert stats.mean_accepted_length == pytest.approx(1 + stats.num_accepted_draft_tokens / stats.num_spec_rows)


@pytest.mark.parametrize("batch", [1, 8])
def test_ngram_greedy_equals_plain_decoding(tiny_llama_dir, vocab, batch):
    params = _greedy(MAX_TOKENS)
    prompts = _tie_free(tiny_llama_dir, vocab, params, 8, seed=batch)
    ref = _generate(_make_llm(tiny_llama_dir, max_num_seqs=batch), prompts, params)
    llm = _make_llm(tiny_llama_dir, max_num_seqs=batch, speculative_config=_ngram(4, disable_by_batch_size=64))
    eng = llm.llm_engine
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in ref]
    stats = eng.spec_stats
    assert stats.num_accepted_draft_tokens > 0 and stats.num_steps_over_batch_limit == 0
    _check_metrics(eng, outs)
    _assert_all_blocks_free(eng)


def test_ngram_with_prefix_cache_and_preemption(tiny_llama_dir, vocab):
    kw = dict(block_size=4, num_kv_blocks=60, enable_prefix_caching=True)
    params = _greedy(MAX_TOKENS)
    prompts = _tie_free(tiny_llama_dir, vocab, params, 8, seed=11, **kw)
    prompts = prompts + [list(p) for p in prompts[:3]]  # repeats: prefix-cache hits
    ref = _generate(_make_llm(tiny_llama_dir, **kw), prompts, params)
    llm = _make_llm(tiny_llama_dir, speculative_config=_ngram(5, disable_by_batch_size=64), **kw)
    eng = llm.llm_engine
    eng.scheduler = recorder = CountingScheduler(eng.scheduler)
    outs = _generate(llm, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert eng.spec_stats.num_accepted_draft_tokens > 0
    assert recorder.num_preempted > 0 and eng.scheduler.prefix_cache_hits > 0
    _assert_all_blocks_free(eng)


def test_seeded_sampling_with_ngram_is_reproducible(tiny_llama_dir, vocab):
    prompts = _repetitive_prompts(vocab, 6, seed=5)
    params = [SamplingParams(temperature=0.3, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(6)]

    def run():
        llm = _make_llm(tiny_llama_dir, speculative_config=_ngram(3, disable_by_batch_size=64))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.llm_engine

    (first, eng), (second, _) = run(), run()
    assert first == second
    assert eng.spec_stats.num_draft_tokens > 0
    _assert_all_blocks_free(eng)


def test_default_batch_limit_turns_drafts_off(tiny_llama_dir, vocab):
    """ngram's default disable_by_batch_size (4), with or without the adaptive switch: 8 decode-ready
    sequences finishing together get none (the switch decides per sequence below the limit)."""
    params = _greedy(12)
    prompts = _repetitive_prompts(vocab, 8, seed=2)
    assert _make_llm(tiny_llama_dir, speculative_config=_ngram(4)).llm_engine.spec_disable_by_batch_size == 4
    llm = _make_llm(tiny_llama_dir, speculative_config={**_ngram(4), "adaptive": False})
    eng = llm.llm_engine
    assert eng.spec_disable_by_batch_size == NgramProposer.default_disable_by_batch_size == 4
    outs = _generate(llm, prompts, params)
    assert eng.spec_stats.num_draft_tokens == 0 and eng.spec_stats.num_steps_over_batch_limit > 0
    assert all(len(o.token_ids) == 12 for o in outs)
    _generate(llm, prompts[:2], params)  # two sequences: drafts again
    assert eng.spec_stats.num_draft_tokens > 0
    _assert_all_blocks_free(eng)


def test_raising_proposer_runs_steps_without_drafts(tiny_llama_dir, vocab, monkeypatch):
    params = _greedy(24)
    prompts = _tie_free(tiny_llama_dir, vocab, params, 4, seed=3)
    ref = _generate(_make_llm(tiny_llama_dir), prompts, params)
    llm = _make_llm(tiny_llama_dir, speculative_config=_ngram(3, disable_by_batch_size=64))
    eng = llm.llm_engine
    real, calls = eng.proposer.propose, []

    def flaky(requests):  # every other call raises
        calls.append(len(requests))
        if len(calls) % 2:
            raise RuntimeError("injected proposer failure")
        return real(requests)

    monkeypatch.setattr(eng.proposer, "propose", flaky)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.error is None and o.finished for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in ref]
    assert eng.spec_stats.num_proposer_errors == (len(calls) + 1) // 2 > 0
    assert eng.spec_stats.num_accepted_draft_tokens > 0  # the other calls still drafted
    _assert_all_blocks_free(eng)


def test_prometheus_spec_counters(tiny_llama_dir, vocab):
    pytest.importorskip("prometheus_client")
    from pagellm.entrypoints.openai.metrics import ServerMetrics

    llm = _make_llm(tiny_llama_dir, speculative_config=_ngram(4, disable_by_batch_size=64))
    eng = llm.llm_engine
    eng.warmup(prompt_lens=(5, 30), max_tokens=8)  # as `pagellm serve` does: its drafts are not counted
    assert eng.spec_stats == SpecDecodeStats()
    _generate(llm, _repetitive_prompts(vocab, 3, seed=8), _greedy(24))
    stats = eng.get_stats()
    assert stats.spec_decode == eng.spec_stats and stats.spec_decode is not eng.spec_stats
    metrics = ServerMetrics("m")
    metrics.render(stats)
    text = metrics.render(stats).decode()  # the same snapshot twice: counted once

    def value(name, **labels):
        labels = {"model_name": "m", **labels}
        return metrics.registry.get_sample_value(name, labels)

    s = stats.spec_decode
    assert value("pagellm:spec_decode_num_drafts_total") == s.num_spec_rows > 0
    assert value("pagellm:spec_decode_num_draft_tokens_total") == s.num_draft_tokens
    assert value("pagellm:spec_decode_num_accepted_tokens_total") == s.num_accepted_draft_tokens
    for i, n in enumerate(s.num_accepted_per_position):
        assert value("pagellm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) == n
    assert "pagellm:spec_decode_num_draft_tokens_per_pos_total" in text
    assert EngineStats().spec_decode is None and ServerMetrics("m").render(EngineStats())  # no proposer: fine


def test_async_llm_with_speculative_config(tiny_llama_dir, vocab):
    import asyncio

    from pagellm.engine.async_llm import AsyncLLM

    params = _greedy(24)
    prompts = _tie_free(tiny_llama_dir, vocab, params, 3, seed=9)
    ref = _generate(_make_llm(tiny_llama_dir), prompts, params)
    front = AsyncLLM.from_engine_args(str(tiny_llama_dir), max_model_len=128, seed=0,
                                      speculative_config=_ngram(3, disable_by_batch_size=8))

    async def one(i, prompt):
        final = None
        async for out in front.generate({"prompt_token_ids": prompt}, params, f"r{i}"):
            final = out
        return final

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        outs = asyncio.run(main())
    finally:
        front.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in ref]
    eng = front.engine
    assert eng.spec_stats.num_accepted_draft_tokens > 0
    _check_metrics(eng, outs)
    _assert_all_blocks_free(eng)
