"""The acceptance-aware switch (spec_decode/switch.py): on a fake clock, then in the engine with proposers
that are always wrong / always right. Outputs never change, only who drafts."""

from __future__ import annotations

import random
from statistics import median

import pytest

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from test_draft_tokens import OracleProposer, _assert_all_blocks_free, _greedy, _make_llm, _prompts  # noqa: E402

from pagellm.spec_decode import SpeculativeConfig  # noqa: E402
from pagellm.spec_decode.switch import SpecSwitch  # noqa: E402

K = 3


def _drive(switch: SpecSwitch, num_rows: int, accepted: int, steps: int, plain_s: float, extra_per_draft_s: float,
           idle_every: int = 0) -> list[int]:
    """Steps on a fake clock: a step takes plain_s plus extra_per_draft_s per draft token. Returns, per step,
    how many rows drafted."""
    now, drafted = [0.0], []
    switch.clock = lambda: now[0]
    ids = [f"s{i}" for i in range(num_rows)]
    for step in range(steps):
        may = switch.begin_step(ids, timed=True)
        on = [sid for sid in ids if may and switch.wants_drafts(sid, num_rows)]
        switch.record_proposals(K * len(on), 0.0, len(on))
        for sid in on:
            switch.record_verify(sid, K, accepted)
        now[0] += plain_s + extra_per_draft_s * K * len(on)
        if idle_every and step % idle_every == 0:
            now[0] += 100 * plain_s  # the engine sat idle: never a timing sample
        drafted.append(len(on))
    return drafted


def _drive_noisy(switch: SpecSwitch, weights: list[float], steps: int, seed: int) -> list[int]:
    """One sequence whose every verify accepts 0 .. K drafts with these probabilities (independent draws, like Medusa
    heads on open chat), on a fake clock: 10 ms a plain step, 0.6 ms per draft token. Returns drafted (0 / 1) per step."""
    rng = random.Random(seed)
    now, drafted = [0.0], []
    switch.clock = lambda: now[0]
    for _ in range(steps):
        on = switch.begin_step(["s"], timed=True) and switch.wants_drafts("s", 1)
        switch.record_proposals(K * on, 0.0, int(on))
        if on:
            switch.record_verify("s", K, rng.choices(range(K + 1), weights)[0])
        now[0] += 0.010 + 0.0006 * K * on
        drafted.append(int(on))
    return drafted


def test_a_slow_acceptance_memory_keeps_noisy_drafts_that_pay():
    """Drafts accepted 0.6 per verify on average but 0 in 62 % of verifies, against a cost of 0.18 tokens: they pay.
    The default weight (0.3) lets a few unlucky verifies switch drafting off, and the re-probe backoff keeps it
    off; Medusa's 0.03 (MedusaProposer.acceptance_decay) averages them out. Drafts that do not pay (0.1 per
    verify) still go off with the slow memory."""
    pays, does_not = [0.62, 0.22, 0.1, 0.06], [0.9, 0.1, 0.0, 0.0]
    fast = [sum(_drive_noisy(SpecSwitch(K), pays, 400, seed)) for seed in range(3)]
    slow = [sum(_drive_noisy(SpecSwitch(K, decay=0.03), pays, 400, seed)) for seed in range(3)]
    assert min(slow) > 0.9 * 400, slow
    assert max(fast) < 0.7 * 400, fast  # what the switch did to Medusa on chat before session 16
    for seed in range(3):
        off = _drive_noisy(SpecSwitch(K, decay=0.03), does_not, 400, seed)
        assert sum(off[200:]) <= 10, sum(off[200:])  # off, re-probes only


def test_always_wrong_drafts_switch_off_but_reprobe():
    switch = SpecSwitch(K, probe_every=16)
    drafted = _drive(switch, 1, accepted=0, steps=200, plain_s=0.010, extra_per_draft_s=0.001)
    assert drafted[:3] == [1, 0, 1]  # optimistic start, the plain-step probe, a verify that measures the cost
    off_from = drafted.index(0, 2)  # switched off once acceptance and cost are known
    assert off_from < 16
    assert 0 < sum(drafted[off_from:]) <= 4  # re-probes only, ever rarer: after 16, 32, 64, 128 steps off
    assert switch.num_switched_off > 180


def test_always_right_drafts_stay_on():
    switch = SpecSwitch(K, probe_every=16)
    drafted = _drive(switch, 1, accepted=K, steps=200, plain_s=0.010, extra_per_draft_s=0.001)
    assert switch.num_switched_off == 0
    assert sum(drafted) >= 200 - 2  # at most the plain-step probe that measured plain_s(1)


def test_same_acceptance_pays_at_batch_1_not_at_batch_8():
    # one accepted draft per verify of 3: at batch 1 a token is worth 10 ms and 3 drafts cost 6 ms; at batch 8
    # a token is worth 12 / 8 = 1.5 ms and the same drafts still cost 6 ms
    alone = _drive(SpecSwitch(K), 1, accepted=1, steps=120, plain_s=0.010, extra_per_draft_s=0.002)
    batched = _drive(SpecSwitch(K), 8, accepted=1, steps=120, plain_s=0.012, extra_per_draft_s=0.002)
    assert sum(alone[60:]) >= 58
    assert sum(batched[60:]) <= 8 * (60 // 16 + 1)


def test_idle_gaps_are_not_timed():
    busy = SpecSwitch(K)
    _drive(busy, 1, accepted=1, steps=60, plain_s=0.010, extra_per_draft_s=0.002, idle_every=3)
    assert busy.num_switched_off == 0  # idle time counted as verify cost would have switched it off


def _drive_with_slow_step(switch: SpecSwitch, slow_step: int, discard: bool, steps: int = 60) -> list[int]:
    """Always-right drafts at batch 1 (10 ms a step, 1 ms a draft) on a fake clock, except that step `slow_step`
    takes 1.6 s more (a step graph's capture, or the machine's load); with `discard` the engine reports it as a
    one-time cost (SpecSwitch.discard_step), as it does when the model runner says a step graph warmed up."""
    now, drafted = [0.0], []
    switch.clock = lambda: now[0]
    for step in range(steps):
        may = switch.begin_step(["s"], timed=True)
        on = may and switch.wants_drafts("s", 1)
        switch.record_proposals(K if on else 0, 0.0, int(on))
        if on:
            switch.record_verify("s", K, K)
        now[0] += 0.010 + (0.001 * K if on else 0.0) + (1.6 if step == slow_step else 0.0)
        if step == slow_step and discard:
            switch.discard_step()
        drafted.append(int(on))
    return drafted


@pytest.mark.parametrize("discard", [True, False])
def test_one_slow_first_verify_does_not_switch_drafting_off(discard):
    """Session 12's ngram at 1.13x: the first verify timed was a graph capture (1.6 s), its cost became the verify
    cost, and an always-paying request stayed off but for rare re-probes. Now it is discarded (the runner flags it)
    or, unflagged, is too slow to be a verify (over IDLE_FACTOR plain steps per token)."""
    switch = SpecSwitch(K, probe_every=16)
    drafted = _drive_with_slow_step(switch, slow_step=2, discard=discard)  # step 1 measured plain, 2: first verify
    assert drafted[1] == 0 and switch.num_switched_off == 0
    assert sum(drafted) == len(drafted) - 1


def test_a_discarded_plain_probe_is_repeated():
    """The plain-step probe (the second timed step) held a one-time cost: the next step probes again."""
    switch = SpecSwitch(K, probe_every=16)
    drafted = _drive_with_slow_step(switch, slow_step=1, discard=True)
    assert drafted[:4] == [1, 0, 0, 1] and switch.num_switched_off == 0
    assert 1 in switch._plain_s and median(switch._plain_s[1]) == pytest.approx(0.010)


def test_the_verify_cost_counts_from_three_samples():
    """Two verifies timed far too slow but under the idle bound (a loaded machine) do not switch drafting off
    alone; a third one does (the median of three)."""
    switch = SpecSwitch(K, probe_every=16)
    now = [0.0]
    switch.clock = lambda: now[0]
    verdicts = []
    for step in range(6):
        may = switch.begin_step(["s"], timed=True)
        verdicts.append(on := may and switch.wants_drafts("s", 1))
        switch.record_proposals(K if on else 0, 0.0, int(on))
        if on:
            switch.record_verify("s", K, 1)
        now[0] += 0.010 + (0.025 * K if on else 0.0)  # each draft costs 2.5 plain steps: never pays
    assert verdicts == [True, False, True, True, True, False]


def test_bad_arguments():
    with pytest.raises(ValueError, match="probe_every"):
        SpecSwitch(K, probe_every=1)
    with pytest.raises(ValueError, match="decay"):
        SpecSwitch(K, decay=0.0)
    with pytest.raises(ValueError, match="adaptive"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"})
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "adaptive": False})
    assert not config.adaptive and config.to_dict()["adaptive"] is False


# ---------------------------------------------------------------- in the engine


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, tiny_tokenizer):
    vocab = len(tiny_tokenizer)
    prompts = _prompts(vocab, [21, 30], seed=11)
    outs = _make_llm(tiny_llama_dir, max_num_seqs=1, max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in prompts], _greedy(120), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return vocab, prompts, tokens


class TickClock:
    """1 ms per reading: a step reads it once, plus twice around the proposer when one is asked, so a plain
    step takes 1 ms and a spec step 3 ms of which 1 ms is the proposer's (drafts cost 2 ms per 3 drafts).
    The real clock on a loaded 2-core machine would make the verdict depend on the load, not on the wiring."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1e-3
        return self.now


def _spec_run(path, prompts, proposer):
    llm = _make_llm(path, max_num_seqs=1, max_model_len=256)
    eng = llm.llm_engine
    eng.set_proposer(proposer, adaptive=True)
    eng.spec_switch.clock = TickClock()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(120), use_tqdm=False)
    _assert_all_blocks_free(eng)
    return [list(o.outputs[0].token_ids) for o in outs], eng


def test_engine_switches_off_an_always_wrong_proposer(tiny_llama_dir, plain):
    vocab, prompts, tokens = plain
    reference = {tuple(p): t for p, t in zip(prompts, tokens)}
    out, eng = _spec_run(tiny_llama_dir, prompts, OracleProposer(K, reference, vocab, wrong_from=0))
    assert out == tokens
    stats = eng.spec_stats
    assert stats.num_accepted_draft_tokens == 0
    assert eng.spec_switch.num_switched_off > 100  # of ~238 decode steps
    assert stats.num_spec_rows < 120


def test_engine_keeps_an_always_right_proposer_on(tiny_llama_dir, plain):
    vocab, prompts, tokens = plain
    reference = {tuple(p): t for p, t in zip(prompts, tokens)}
    out, eng = _spec_run(tiny_llama_dir, prompts, OracleProposer(K, reference, vocab))
    assert out == tokens
    assert eng.spec_switch.num_switched_off == 0
    assert eng.spec_stats.num_accepted_draft_tokens == eng.spec_stats.num_draft_tokens > 100


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_engine_leaves_step_graph_warmups_untimed(tiny_llama_dir, plain, enforce_eager):
    """Steps whose graph key was new (eager first sighting, capture) are reported by the runner and discarded by the
    switch; eager engines (no graphs) have no such steps."""
    vocab, prompts, tokens = plain
    reference = {tuple(p): t for p, t in zip(prompts, tokens)}
    llm = _make_llm(tiny_llama_dir, max_num_seqs=1, max_model_len=256, enforce_eager=enforce_eager)
    eng = llm.llm_engine
    eng.set_proposer(OracleProposer(K, reference, vocab, wrong_from=1), adaptive=True)
    eng.spec_switch.clock = TickClock()
    discarded, warmups = [], []
    switch_discard, execute = eng.spec_switch.discard_step, eng.executor.execute_model

    def discard_step():
        discarded.append(eng.spec_switch._step is not None)
        switch_discard()

    def execute_model(*args, **kwargs):
        result = execute(*args, **kwargs)
        warmups.append(result.graph_warmup)
        return result

    eng.spec_switch.discard_step, eng.executor.execute_model = discard_step, execute_model
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(120), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == tokens
    assert len(discarded) == sum(warmups)
    graphs = eng.runner.step_graphs
    if enforce_eager:
        assert graphs is None and not discarded
    else:  # a decode key and a verify key (1 + K tokens) at least, each seen eagerly then captured; some timed
        assert sum(warmups) == graphs.num_warmup_runs >= 4 and any(discarded)


# ---------------------------------------------------------------- adaptive k (SpecSwitch.num_drafts)
def _drive_adaptive(switch: SpecSwitch, first_wrong: int | None, steps: int, plain_s: float = 0.010,
                    extra_per_draft_s: float = 0.001, proposer_per_draft_s: float = 0.0) -> list[int]:
    """One row on a fake clock whose drafts are right up to `first_wrong` (None: always right). Returns the number of
    drafts asked for per step (0: no drafts)."""
    now, asked = [0.0], []
    switch.clock = lambda: now[0]
    for _ in range(steps):
        may = switch.begin_step(["s"], timed=True)
        n = switch.num_drafts("s", 1)
        on = may and switch.wants_drafts("s", 1, n)
        switch.record_proposals(n if on else 0, proposer_per_draft_s * n if on else 0.0, int(on))
        if on:
            switch.record_verify("s", n, n if first_wrong is None else min(first_wrong, n))
        now[0] += plain_s + ((extra_per_draft_s + proposer_per_draft_s) * n if on else 0.0)
        asked.append(n if on else 0)
    return asked


def test_adaptive_k_starts_at_k_and_keeps_it_for_right_drafts():
    switch = SpecSwitch(8)
    assert switch.num_drafts("new", 1) == 8  # nothing measured yet
    asked = _drive_adaptive(switch, None, steps=60)
    assert asked[0] == 8 and all(n == 8 for n in asked[10:])


@pytest.mark.parametrize("first_wrong, expected", [(0, 1), (1, 2), (3, 5), (7, 8)])
def test_adaptive_k_fits_the_drafts_to_where_they_go_wrong(first_wrong, expected):
    """Drafts right up to position j: the estimated per-draft rate is a = j / (j + 1); with 10 ms a token and 1 ms a
    draft the geometric model's best count is 1 for a = 0, 2 for 1/2, 5 for 3/4 (4 and 6 give fewer tokens per
    second), k = 8 for 7/8."""
    asked = _drive_adaptive(SpecSwitch(8), first_wrong, steps=80)
    tail = [n for n in asked[40:] if n]
    assert tail and all(n == expected for n in tail), asked


def test_adaptive_k_tokens_per_second_model():
    """num_drafts maximises (1 + a (1 - a^n) / (1 - a)) / (plain + n extra): a = 1/2, plain 10 ms, extra 1 ms -> 2."""
    switch = SpecSwitch(6)
    _drive_adaptive(switch, 1, steps=40, plain_s=0.010, extra_per_draft_s=0.001)
    rate = 0.5
    best = max(range(1, 7), key=lambda n: (1 + rate * (1 - rate**n) / (1 - rate)) / (0.010 + n * 0.001))
    assert switch.num_drafts("s", 1) == best == 2


def test_engine_adaptive_k_outputs_equal_plain(tiny_llama_dir, plain):
    """A proposer right for two drafts of eight, then wrong: the switch asks for fewer drafts, outputs stay plain's."""
    vocab, prompts, tokens = plain
    reference = {tuple(p): t for p, t in zip(prompts, tokens)}
    # eager: with step graphs every new draft count's first two steps (a new graph key) go untimed, which leaves this
    # short run few timed verifies; the switch's wiring is the same either way
    llm = _make_llm(tiny_llama_dir, max_num_seqs=1, max_model_len=256, enforce_eager=True)
    eng = llm.llm_engine
    eng.set_proposer(OracleProposer(8, reference, vocab, wrong_from=2), adaptive=True, adaptive_k=True)
    clock = TickClock()
    eng.spec_switch.clock = clock
    orig = eng.spec_switch.record_proposals

    def record_proposals(num_draft_tokens, proposer_s, num_proposed):  # drafts cost time on the fake clock
        clock.now += 2e-3 * num_draft_tokens
        orig(num_draft_tokens, proposer_s, num_proposed)

    eng.spec_switch.record_proposals = record_proposals
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(120), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == tokens
    _assert_all_blocks_free(eng)
    stats = eng.spec_stats
    assert stats.num_spec_rows > 0 and stats.num_draft_tokens < 5 * stats.num_spec_rows  # not 8 per verify


def test_adaptive_k_counts_a_draft_models_time_per_draft():
    """Right drafts from a proposer that spends a target step per draft (a draft model as big as its target): more
    drafts only add time, so the switch asks for one, and mostly none."""
    switch = SpecSwitch(8)
    asked = _drive_adaptive(switch, None, steps=120, proposer_per_draft_s=0.010)
    assert switch.num_drafts("s", 1) == 1
    assert sum(1 for n in asked[60:] if n) <= 8 and switch.num_switched_off > 40  # off but for the re-probes


def test_adaptive_k_option():
    default = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert default.adaptive_k is False and "adaptive_k" not in default.to_dict()
    on = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "adaptive_k": True})
    assert on.adaptive_k is True and on.to_dict()["adaptive_k"] is True
    with pytest.raises(ValueError, match="adaptive_k"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "adaptive_k": 1})


def test_engine_without_adaptive_k_drafts_k(tiny_llama_dir, plain):
    """adaptive_k=False (the default): the switch still decides whether a sequence drafts, never how many."""
    vocab, prompts, tokens = plain
    reference = {tuple(p): t for p, t in zip(prompts, tokens)}
    llm = _make_llm(tiny_llama_dir, max_num_seqs=1, max_model_len=256)
    eng = llm.llm_engine
    eng.set_proposer(OracleProposer(8, reference, vocab, wrong_from=2), adaptive=True)
    eng.spec_switch.clock = TickClock()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(120), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == tokens
    _assert_all_blocks_free(eng)
    stats = eng.spec_stats
    assert stats.num_spec_rows > 0
    assert stats.num_draft_tokens >= 7 * stats.num_spec_rows  # k = 8, but near max_tokens / max_model_len


def test_a_request_is_costed_at_its_own_recent_draft_count():
    """A proposer whose drafts follow the match (ngram's draft_length "match") drafts fewer than k: the switch costs a
    request's drafting at its EWMA of drafts per verify, not at k. With k = 12, 1 draft per verify, 1 accepted, a plain
    step of 10 ms and 2 ms per draft token: 12 drafts would cost 24 ms for a 10 ms token (off); 1 draft costs 2 ms
    (on). Before its first verify a request is costed at k; an explicit num_drafts still wins."""
    k, now = 12, [0.0]
    switch = SpecSwitch(k, clock=lambda: now[0])
    for _ in range(40):  # the costs get measured from the request's one-draft verifies (and the plain-step probe)
        if switch.begin_step(["a"], timed=True):
            switch.record_proposals(1, 0.0, 1)
            switch.record_verify("a", 1, 1)
            now[0] += 0.002
        now[0] += 0.010
    switch.begin_step(["a", "b"], timed=False)
    switch.begin_step(["a"], timed=True)
    assert switch._drafts["a"] == pytest.approx(1.0)
    assert switch.wants_drafts("a", 1)  # costed at its 1 draft per verify
    assert not switch.wants_drafts("a", 1, num_drafts=k)  # at k it would not pay
    assert switch._draft_cost_s(1, k) > 0.010 * (switch.acceptance("a") - 0.1)
    switch.begin_step(["a", "new"], timed=False)
    assert "new" not in switch._drafts  # unknown requests are costed at k until their first verify
