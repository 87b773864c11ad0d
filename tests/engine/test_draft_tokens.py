"""Draft tokens in the step (the speculative-decoding seam) with fake proposers on a tiny random Llama (fp32):
outputs must equal plain decoding, the KV cache must come back whole, verification must be lossless."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.sampling import Sampler, SamplingRow, build_sampling_metadata, expand_rows_for_verify  # noqa: E402
from pagellm.spec_decode import BaseProposer  # noqa: E402
from scheduler_probes import CountingScheduler  # noqa: E402

PROMPT_LENS = [3, 9, 17, 26, 40, 5]
MAX_TOKENS = 24


def _prompts(vocab: int, lens=PROMPT_LENS, shared_prefix: int = 0, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(5, vocab) for _ in range(n)] for n in lens]


MIN_MARGIN = 1e-3  # fp32 decode vs multi-token attention differ by ~1e-5: only near-ties could flip


def _tie_free_prompts(path, vocab, params, lens=PROMPT_LENS, shared_prefix=0, seed=0, **kw) -> list[list[int]]:
    """Prompts of the given lengths whose greedy continuation under `params` never has a top-2 logit gap
    below MIN_MARGIN (a plain run with processed top-2 logprobs decides), so that plain and speculative
    runs, which compute a position through different kernels, must agree token for token."""
    probe = params.clone()
    probe.logprobs, probe.logprobs_mode = max(2, params.logprobs or 0), "processed"
    candidates = [_prompts(vocab, lens, shared_prefix, seed + attempt) for attempt in range(8)]
    flat = [p for batch in candidates for p in batch]
    outs = _generate(_make_llm(path, **kw), flat, probe)
    margins = []
    for o in outs:
        gaps = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in o.logprobs]
        margins.append(min(g[0] - g[1] for g in gaps))
    chosen = []
    for j in range(len(lens)):
        ok = [batch[j] for a, batch in enumerate(candidates) if margins[a * len(lens) + j] > MIN_MARGIN]
        assert ok, f"no tie-free prompt of length {lens[j]}"
        chosen.append(ok[0])
    return chosen


def _greedy(n=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _make_llm(path, **kw):
    kw.setdefault("max_model_len", 128)
    kw.setdefault("seed", 0)
    return LLM(str(path), **kw)


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


class OracleProposer(BaseProposer):
    """Proposes the true continuation (from a plain run), wrong from `wrong_from` on, per prompt; with
    `p_wrong`, a random position of the drafts is replaced by a wrong token. `strict`: the sequence so far
    must be the plain run's (greedy)."""

    def __init__(self, k, reference: dict[tuple, list[int]], vocab: int, wrong_from: int | None = None,
                 p_wrong: float = 0.0, seed: int = 0, strict: bool = True):
        super().__init__(k)
        self.reference, self.vocab, self.wrong_from, self.p_wrong = reference, vocab, wrong_from, p_wrong
        self.strict = strict
        self.rng = random.Random(seed)
        self.num_calls = 0

    def _wrong(self, true_token: int) -> int:
        return (true_token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab

    def propose(self, requests):
        self.num_calls += 1
        drafts = {}
        for r in requests:
            ref = self.reference[tuple(r.prompt_token_ids)]
            n = len(r.output_token_ids)
            assert not self.strict or list(r.output_token_ids) == ref[:n]  # the engine hands over the sequence
            true = ref[n : n + self.num_speculative_tokens]
            d = list(true)
            if self.wrong_from is not None:
                d = d[: self.wrong_from] + [self._wrong(t) for t in true[self.wrong_from :]]
            if d and self.rng.random() < self.p_wrong:
                j = self.rng.randrange(len(d))
                d[j] = self._wrong(true[j])
            drafts[r.seq_id] = d
        return drafts


def _reference(path, prompts, params, **kw) -> tuple[list, dict[tuple, list[int]], int]:
    llm = _make_llm(path, **kw)
    steps0 = llm.llm_engine.scheduler.num_steps
    outs = _generate(llm, prompts, params)
    return outs, {tuple(p): list(o.token_ids) for p, o in zip(prompts, outs)}, llm.llm_engine.scheduler.num_steps - steps0


def _assert_all_blocks_free(eng):
    assert not eng.has_unfinished_requests()
    assert eng.scheduler.num_running == 0 and eng.scheduler.num_waiting == 0
    assert eng.num_free_blocks == eng.scheduler.num_blocks  # the scheduler has no reserved (null) block


@pytest.fixture(scope="module")
def vocab(tiny_tokenizer):
    return len(tiny_tokenizer)


# ---------------------------------------------------------------- (a) (b) (d): oracle and wrong proposers


@pytest.mark.parametrize("backend", [None, "torch"], ids=["default-backend", "torch-backend"])
def test_oracle_proposer_all_accepted_fewer_steps(tiny_llama_dir, vocab, backend):
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy())
    ref_outs, reference, ref_steps = _reference(tiny_llama_dir, prompts, _greedy(), attention_backend=backend)
    llm = _make_llm(tiny_llama_dir, attention_backend=backend)
    eng = llm.llm_engine
    eng.set_proposer(OracleProposer(4, reference, vocab))
    steps0 = eng.scheduler.num_steps
    outs = _generate(llm, prompts, _greedy())
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    stats = eng.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_draft_tokens == stats.num_draft_tokens
    # 1 prefill step + ceil(23 / 5) spec steps instead of 24 steps per request
    assert eng.scheduler.num_steps - steps0 <= ref_steps // 3
    _assert_all_blocks_free(eng)


def test_wrong_proposer_all_rejected_same_output(tiny_llama_dir, vocab):
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy())
    ref_outs, reference, ref_steps = _reference(tiny_llama_dir, prompts, _greedy())
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    eng.set_proposer(OracleProposer(3, reference, vocab, wrong_from=0))
    steps0 = eng.scheduler.num_steps
    outs = _generate(llm, prompts, _greedy())
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    assert eng.spec_stats.num_draft_tokens > 0 and eng.spec_stats.num_accepted_draft_tokens == 0
    assert eng.scheduler.num_steps - steps0 == ref_steps
    _assert_all_blocks_free(eng)


def test_no_proposer_after_set_proposer_none(tiny_llama_dir, vocab):
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(8), [4, 11])
    ref_outs, reference, _ = _reference(tiny_llama_dir, prompts, _greedy(8))
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    proposer = OracleProposer(2, reference, vocab)
    eng.set_proposer(proposer)
    eng.set_proposer(None)
    assert eng.proposer is None and eng.scheduler.num_lookahead_tokens == 0
    outs = _generate(llm, prompts, _greedy(8))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs] and proposer.num_calls == 0


# ---------------------------------------------------------------- (c) mixed batch, prefix cache, preemption


def test_mixed_drafts_prefix_cache_and_preemption_match_plain_greedy(tiny_llama_dir, vocab):
    kw = dict(block_size=4, num_kv_blocks=40, enable_prefix_caching=True)
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(), [3, 9, 17, 26, 30, 5, 12, 21], 8, seed=1)
    ref_outs, reference, _ = _reference(tiny_llama_dir, prompts, _greedy(), **kw)
    llm = _make_llm(tiny_llama_dir, **kw)
    eng = llm.llm_engine
    eng.scheduler = recorder = CountingScheduler(eng.scheduler)
    eng.set_proposer(OracleProposer(5, reference, vocab, p_wrong=0.5, seed=3))
    outs = _generate(llm, prompts, _greedy())
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    stats = eng.spec_stats
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert recorder.num_preempted > 0
    assert eng.scheduler.prefix_cache_hits > 0
    _assert_all_blocks_free(eng)


def test_stops_inside_accepted_run_truncate_it(tiny_llama_dir, vocab):
    """A stop token, EOS-like stop id or max_tokens inside the accepted drafts ends the output there."""
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(), [6, 13, 20], seed=2)
    _, full, _ = _reference(tiny_llama_dir, prompts, _greedy(MAX_TOKENS))
    stop_id = full[tuple(prompts[0])][7]  # a token the first request produces mid-way
    params = [_greedy(MAX_TOKENS, stop_token_ids=[stop_id]), _greedy(10), _greedy(MAX_TOKENS, stop_token_ids=[stop_id])]
    ref_outs, _, _ = _reference(tiny_llama_dir, prompts, params)
    assert len(ref_outs[0].token_ids) <= 8 and ref_outs[0].finish_reason == "stop"
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    eng.set_proposer(OracleProposer(6, full, vocab))  # proposes past every stop
    outs = _generate(llm, prompts, params)
    for got, exp in zip(outs, ref_outs):
        assert (got.token_ids, got.finish_reason, got.stop_reason) == (exp.token_ids, exp.finish_reason, exp.stop_reason)
    assert eng.num_generation_tokens_total == sum(len(o.token_ids) for o in outs)
    _assert_all_blocks_free(eng)


def test_penalties_and_logprobs_see_the_accepted_drafts(tiny_llama_dir, vocab):
    """Penalties at draft position j count drafts 0..j-1; logprobs come per accepted token."""
    params = _greedy(16, repetition_penalty=1.4, frequency_penalty=0.6, logprobs=3)
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, params, [7, 15], seed=4)
    ref_outs, reference, _ = _reference(tiny_llama_dir, prompts, params)
    llm = _make_llm(tiny_llama_dir)
    llm.llm_engine.set_proposer(OracleProposer(4, reference, vocab, p_wrong=0.3, seed=5))
    outs = _generate(llm, prompts, params)
    assert llm.llm_engine.spec_stats.num_accepted_draft_tokens > 0
    for got, exp in zip(outs, ref_outs):
        assert got.token_ids == exp.token_ids
        assert len(got.logprobs) == len(exp.logprobs) == len(got.token_ids)
        for g, e in zip(got.logprobs, exp.logprobs):
            assert g.keys() == e.keys()
            for t in g:
                assert g[t].rank == e[t].rank
                assert g[t].logprob == pytest.approx(e[t].logprob, abs=1e-4)
        assert got.cumulative_logprob == pytest.approx(exp.cumulative_logprob, abs=1e-3)


def test_seeded_sampling_with_drafts_is_reproducible(tiny_llama_dir, vocab):
    prompts = _prompts(vocab, lens=[5, 18], seed=6)
    params = SamplingParams(temperature=0.02, top_k=20, seed=123, max_tokens=16, ignore_eos=True)
    _, reference, _ = _reference(tiny_llama_dir, prompts, _greedy(16))  # likely tokens at a very low temperature

    def run():
        llm = _make_llm(tiny_llama_dir)
        llm.llm_engine.set_proposer(OracleProposer(3, reference, vocab, strict=False))
        return [o.token_ids for o in _generate(llm, prompts, params)], llm.llm_engine.spec_stats

    (first, stats), (second, _) = run(), run()
    assert first == second
    # at temperature 0.02 the greedy continuation is likely (p(d) near 1 where the top-2 gap is > 0.05)
    assert stats.num_accepted_draft_tokens > 0


# ---------------------------------------------------------------- the runner's hidden states


def test_runner_returns_hidden_states_of_requested_rows(tiny_llama_dir, vocab):
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    eng.set_proposer(OracleProposer(3, {}, vocab))  # lookahead slots; the proposer is never asked here
    eng.add_request("a", {"prompt_token_ids": _prompts(vocab, lens=[9])[0]}, _greedy(8))
    eng.add_request("b", {"prompt_token_ids": _prompts(vocab, lens=[4], seed=9)[0]}, _greedy(8))
    eng.proposer = None  # drive the scheduler by hand below
    eng.step()
    assert eng.scheduler.set_draft_tokens("b", [11, 12, 13]) == 3
    sched_out = eng.scheduler.schedule()
    assert list(sched_out.request_ids) == ["a", "b"] and sched_out.num_scheduled_tokens.tolist() == [1, 4]
    result = eng.runner.execute(sched_out, [], hidden_state_rows=[1, 0])
    hidden = result.hidden_states
    assert hidden.shape == (5, eng.model_files.hf_config.hidden_size)
    # rows in the requested order: b's 4 positions, then a's one; their logits are the runner's logits
    torch.testing.assert_close(eng.model.compute_logits(hidden[:4]), result.logits[1:5])
    torch.testing.assert_close(eng.model.compute_logits(hidden[4:]), result.logits[:1])


# ---------------------------------------------------------------- (e) verify(): greedy and lossless sampling


def test_verify_greedy_accepts_longest_matching_prefix():
    logits = torch.full((4, 8), -1.0)
    for pos, tok in enumerate([2, 5, 1, 7]):
        logits[pos, tok] = 3.0  # argmax per position
    params = SamplingParams(temperature=0.0)
    cases = {(2, 5, 1): [2, 5, 1, 7], (2, 5, 0): [2, 5, 1], (3, 5, 1): [2], (2, 6, 1): [2, 5]}
    for drafts, expected in cases.items():
        md = build_sampling_metadata(expand_rows_for_verify([SamplingRow(params, [1], [], None)], [drafts]), 8)
        out = Sampler().verify(logits, [list(drafts)], md)
        assert out.accepted_token_ids == [expected] and out.num_accepted_tokens == [len(expected)]


def _tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["one-hot-q", "draft-q"])
def test_verify_sampled_rows_follow_the_target_distribution(with_draft_probs):
    """Rejection sampling is lossless: the first emitted token ~ p_0 and, after an accepted draft, the
    second ~ p_1. One-hot q: for fixed drafts (a likely token, not the top one). A proposer with its own
    q: for drafts drawn from q. Tolerance: total variation <= 0.03 at 6000 (first) / >= 1500 (second)
    draws over 6 tokens (the sampling noise is ~0.01)."""
    V, n = 6, 6000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=gen) * 1.5
    params = SamplingParams(temperature=0.9, top_k=5)
    scaled = logits / 0.9  # the reference: temperature, then top-k, then softmax
    kth = scaled.topk(5, dim=-1).values[:, -1:]
    p = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1).numpy()
    q = None
    if with_draft_probs:
        q = torch.softmax(torch.randn(2, V, generator=gen), dim=-1)
        drafts = [[int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)] for _ in range(n)]
    else:
        drafts = [[int(np.argsort(p[0])[-2]), int(np.argmax(p[1]))]] * n
    rows = [SamplingRow(params, [1], [], None) for _ in range(n)]
    md = build_sampling_metadata(expand_rows_for_verify(rows, drafts), V)
    sampler = Sampler(torch.Generator().manual_seed(1))
    out = sampler.verify(logits.repeat(n, 1), drafts, md, None if q is None else q.repeat(n, 1))
    first = np.bincount([toks[0] for toks in out.accepted_token_ids], minlength=V)
    assert _tv(first, p[0]) <= 0.03
    seconds = [toks[1] for toks in out.accepted_token_ids if len(toks) > 1]
    second = np.bincount(seconds, minlength=V)
    assert second.sum() >= 1500 and _tv(second, p[1]) <= 0.03
    lengths = np.bincount(out.num_accepted_tokens, minlength=4)
    assert lengths[1] > 0 and lengths[2:].sum() > 0  # some rejections and some acceptances


def test_verify_is_deterministic_per_seeded_row():
    V = 10
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=7)

    def run(batch_before: int):
        rows = [SamplingRow(SamplingParams(temperature=1.0), [1], [], None) for _ in range(batch_before)]
        rows.append(SamplingRow(params, [1], [], torch.Generator().manual_seed(7)))
        drafts = [[1, 2]] * len(rows)
        md = build_sampling_metadata(expand_rows_for_verify(rows, drafts), V)
        out = Sampler(torch.Generator().manual_seed(batch_before)).verify(logits.repeat(len(rows), 1), drafts, md)
        return out.accepted_token_ids[-1]

    assert run(0) == run(3) == run(5)  # the seeded row does not depend on the rest of the batch


# ---------------------------------------------------------------- (f) bad input


def test_bad_drafts_raise_and_leave_state_unchanged(tiny_llama_dir, vocab):
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(12), [6, 8], seed=7)
    ref_outs, reference, _ = _reference(tiny_llama_dir, prompts, _greedy(12))
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    eng.set_proposer(OracleProposer(2, reference, vocab))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, _greedy(12))
    eng.step()  # prefill: both decode-ready now
    sched = eng.scheduler
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        sched.set_draft_tokens("r0", [1, 2, 3])
    with pytest.raises(KeyError):
        sched.set_draft_tokens("nope", [1])
    with pytest.raises(ValueError):
        sched.set_draft_tokens("r0", [-1])
    assert sched.get_request("r0").draft_token_ids == []
    # a proposer returning too many drafts, an unknown id or an out-of-vocabulary token fails the step
    # before anything is scheduled, even when another sequence's drafts were fine: the step's (decode-ready)
    # requests finish with the error and their blocks are freed; the engine goes on (engine/step_recovery.py)
    good = eng.proposer
    ok = reference[tuple(prompts[0])][1:3]
    cases = [({"r0": [1, 2, 3]}, ValueError), ({"r0": ok, "zzz": [1]}, KeyError), ({"r0": ok, "r1": [vocab]}, ValueError)]
    for proposals, error in cases:
        class Bad(BaseProposer):
            def propose(self, requests, proposals=proposals):
                return proposals
        eng.set_proposer(Bad(2))
        steps = sched.num_steps
        outs = eng.step()
        assert sched.num_steps == steps
        assert sorted(o.request_id for o in outs) == ["r0", "r1"]
        assert all(o.finished and o.error.startswith(error.__name__) for o in outs)
        assert not eng.has_unfinished_requests()
        _assert_all_blocks_free(eng)
        eng.set_proposer(good)  # queue and prefill both again for the next case
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", {"prompt_token_ids": p}, _greedy(12))
        eng.step()
    with pytest.raises(TypeError):
        eng.set_proposer(object())
    eng.set_proposer(good)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert [done["r0"], done["r1"]] == [o.token_ids for o in ref_outs]
    _assert_all_blocks_free(eng)


def test_verify_rejects_mismatched_shapes():
    params = SamplingParams(temperature=0.0)
    rows = [SamplingRow(params, [1], [], None)]
    md = build_sampling_metadata(expand_rows_for_verify(rows, [[1, 2]]), 5)
    sampler = Sampler(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="target_logits"):
        sampler.verify(torch.zeros(2, 5), [[1, 2]], md)
    with pytest.raises(ValueError, match="vocabulary|\\[0, 5\\)"):
        sampler.verify(torch.zeros(3, 5), [[1, 7]], md)
    with pytest.raises(ValueError, match="draft_probs"):
        sampler.verify(torch.zeros(3, 5), [[1, 2]], md, torch.zeros(3, 5))
    md_short = build_sampling_metadata(rows, 5)
    with pytest.raises(ValueError, match="one per target position"):
        sampler.verify(torch.zeros(3, 5), [[1, 2]], md_short)
