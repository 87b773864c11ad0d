"""ngram's cost-sized drafts (`"draft_length": "cost"`, spec_decode/ngram_policy.py): the continuation estimates the
matchers record, the draft length against a brute-force argmax of expected tokens per unit of step time, the
`draft_token_cost` option, the switch's measured cost handed to the proposer, and greedy outputs equal to plain
decoding (fp32 here; bf16 in test_spec_bf16_invariance.py)."""

from __future__ import annotations

import random

import pytest

from pagellm.spec_decode import DraftRequest, SpeculativeConfig
from pagellm.spec_decode.ngram import DEFAULT_DRAFT_TOKEN_COST, NgramProposer
from pagellm.spec_decode.ngram_index import SequenceMatcher
from pagellm.spec_decode.ngram_policy import (
    MAX_BUCKET_WEIGHT,
    NUM_BUCKETS,
    ContinuationStats,
    best_draft_length,
    length_bucket,
)
from pagellm.spec_decode.switch import SpecSwitch


def test_length_buckets_are_exact_then_doubling():
    assert [length_bucket(n) for n in range(1, 17)] == list(range(16))
    assert length_bucket(17) == length_bucket(32) == 16
    assert length_bucket(33) == length_bucket(64) == 17
    assert length_bucket(10**6) == NUM_BUCKETS - 1
    assert all(length_bucket(n) <= length_bucket(n + 1) for n in range(1, 2000))


def test_stats_start_at_the_prior_and_follow_the_outcomes():
    stats = ContinuationStats()
    assert stats.probability(1) == pytest.approx(0.5) and stats.probability(9) == pytest.approx(0.9)
    for _ in range(200):
        stats.record(3, False)
    assert stats.probability(3) < 0.05
    assert stats.probability(2) == pytest.approx(2 / 3)  # other lengths untouched
    for _ in range(3 * int(MAX_BUCKET_WEIGHT)):  # old outcomes are halved away: the estimate follows the text
        stats.record(3, True)
    assert stats.probability(3) > 0.7
    assert stats.seen[length_bucket(3)] <= MAX_BUCKET_WEIGHT


def _brute_force(probs: list[float], agreed: int, k: int, cost: float) -> int:
    """The d in 0..k maximising (1 + sum_i prod_{j<i} p(agreed + j)) / (1 + cost d); the smallest on a tie."""
    def rate(d: int) -> float:
        expected, survive = 0.0, 1.0
        for i in range(d):
            survive *= probs[agreed + i]
            expected += survive
        return (1.0 + expected) / (1.0 + cost * d)

    rates = [rate(d) for d in range(k + 1)]
    best = max(rates)
    return next(d for d, r in enumerate(rates) if r >= best / (1.0 + 1e-9))


def test_best_draft_length_is_the_argmax_of_tokens_per_time():
    rng = random.Random(5)
    for _ in range(300):
        stats = ContinuationStats()
        for _ in range(rng.randrange(0, 400)):
            n = rng.randrange(1, 40)
            stats.record(n, rng.random() < n / (n + rng.choice([0.5, 2.0, 8.0])))
        agreed, k, cost = rng.randrange(1, 30), rng.randrange(1, 20), rng.choice([0.01, 0.05, 0.1, 0.3, 1.0])
        probs = [stats.probability(max(n, 1)) for n in range(agreed + k + 1)]
        assert best_draft_length(stats, agreed, k, cost) == _brute_force(probs, agreed, k, cost)


def test_long_drafts_where_the_match_held_none_where_it_is_weak():
    stats, rng = ContinuationStats(), random.Random(1)
    for n in range(1, 64):  # short matches break, long ones go on
        for _ in range(50):
            stats.record(n, rng.random() < (0.2 if n < 4 else 0.97))
    assert best_draft_length(stats, 40, 12, 0.08) == 12
    assert best_draft_length(stats, 1, 12, 0.3) == 0
    assert best_draft_length(stats, 0, 12, 0.01) == 0  # no match: nothing to draft
    assert best_draft_length(stats, 40, 0, 0.01) == 0
    assert best_draft_length(stats, 40, 12, 1e-6) == 12


def test_matchers_record_each_followed_match_outcome():
    stats = ContinuationStats()
    seen0 = stats.seen.copy()
    text = list(range(10, 30))
    m = SequenceMatcher(stats)
    m.extend(text + [99] + text[:2])  # no match followed while extending: nothing recorded
    assert (stats.seen == seen0).all() and stats.num_recorded == 0
    end, agreed = m.find(1, 4, 64)
    assert agreed == 2
    m.extend(text[2:6] + [7])  # four agree (at lengths 2..5), the fifth breaks at length 6
    assert stats.num_recorded == 5
    went_on = stats.went_on - ContinuationStats().went_on
    assert [went_on[length_bucket(n)] for n in range(2, 7)] == pytest.approx([1, 1, 1, 1, 0])
    assert stats.seen[length_bucket(6)] == seen0[length_bucket(6)] + 1


def _request(tokens: list[int], k: int) -> DraftRequest:
    return DraftRequest("s", tokens[:5], tokens[5:], max_num_drafts=k)


def test_cost_drafts_copy_runs_and_nothing_without_a_match():
    text = list(range(100, 160))
    proposer = NgramProposer(12, draft_length="cost", draft_token_cost=0.05)
    assert proposer.propose([_request(list(range(40)), 12)]) == {}  # nothing recurs
    seq = text + [1] + text[:30]  # 30 tokens into a copy of 60
    assert proposer.propose([_request(seq, 12)])["s"] == text[30:42]
    # one draft only: a cost that no estimate pays
    assert NgramProposer(12, draft_length="cost", draft_token_cost=1.0).propose([_request(seq, 12)]) == {}


def test_draft_token_cost_follows_the_engine_unless_pinned():
    measured = NgramProposer(8, draft_length="cost")
    assert measured.draft_token_cost == DEFAULT_DRAFT_TOKEN_COST
    measured.set_draft_token_cost(None)
    assert measured.draft_token_cost == DEFAULT_DRAFT_TOKEN_COST
    measured.set_draft_token_cost(0.02)
    assert measured.draft_token_cost == 0.02
    pinned = NgramProposer(8, draft_length="cost", draft_token_cost=0.3)
    pinned.set_draft_token_cost(0.02)
    assert pinned.draft_token_cost == 0.3


@pytest.mark.parametrize("value", [0, -0.1, 1.5, "0.1", True, float("nan")])
def test_bad_draft_token_cost_raises_naming_the_option(value):
    with pytest.raises(ValueError, match="draft_token_cost"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 8, "draft_length": "cost",
                                     "draft_token_cost": value})


def test_draft_token_cost_needs_the_cost_draft_length():
    with pytest.raises(ValueError, match="draft_token_cost"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 8, "draft_token_cost": 0.1,
                                     "draft_length": "match"})
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 8, "draft_length": "cost",
                                       "draft_token_cost": 0.1})
    assert cfg.options == {"draft_length": "cost", "draft_token_cost": 0.1}


def test_switch_measures_the_draft_token_cost():
    """10 ms plain steps of 2 rows, 1 ms per draft token: a draft costs 0.2 of a row's 5 ms, from the third spec
    step timed on."""
    now = [0.0]
    switch = SpecSwitch(4, clock=lambda: now[0])
    ids = ["a", "b"]
    costs = []
    for _ in range(12):
        may = switch.begin_step(ids, timed=True)
        costs.append(switch.draft_token_cost(2))
        drafts = 4 * len(ids) if may else 0
        switch.record_proposals(drafts, 0.0, len(ids) if may else 0)
        now[0] += 0.010 + 0.001 * drafts
    assert costs[0] is None
    assert costs[-1] == pytest.approx(0.2)
    assert switch.draft_token_cost(1) is None  # no step of 1 row timed


def test_engine_hands_the_measured_cost_and_outputs_equal_plain(tiny_llama_dir, tiny_tokenizer):
    pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")
    from test_draft_tokens import _assert_all_blocks_free, _generate, _greedy, _make_llm
    from test_spec_ngram import _tie_free
    from test_spec_switch import TickClock

    params = _greedy(40)
    prompts = _tie_free(tiny_llama_dir, len(tiny_tokenizer), params, 6, seed=23)
    ref = _generate(_make_llm(tiny_llama_dir, max_num_seqs=1), prompts, params)
    llm = _make_llm(tiny_llama_dir, max_num_seqs=1, speculative_config={
        "method": "ngram", "num_speculative_tokens": 12, "draft_length": "cost"})
    eng = llm.llm_engine
    eng.spec_switch.clock = TickClock()
    handed = []
    set_cost = eng.proposer.set_draft_token_cost
    eng.proposer.set_draft_token_cost = lambda cost: (handed.append(cost), set_cost(cost))
    outs = _generate(llm, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert handed[0] is None and any(c is not None for c in handed)
    assert eng.proposer.draft_token_cost == [c for c in handed if c is not None][-1]
    assert eng.proposer.continuation_stats.num_recorded > 0
    _assert_all_blocks_free(eng)
