"""The engine survives bad input and faults (hardening, part A).

Item 1: an out-of-range seed (above 2**64 - 1, or n=2 with seed=2**64 - 1) used to be half-registered and
then kill AsyncLLM's engine loop; an exception inside step() killed the loop for good.
Item 7: offline LLM was unusable after any exception inside step() (Ctrl-C included: "call update() for
step N first"); logprobs=10**6 was accepted and crashed the step; seed=2**70 left a waiting request behind.

Faults are injected (a runner / sampler / detokenizer / proposer / scheduler update that raises once) and
the engine is checked afterwards: no request left anywhere, every KV block free, no pending scheduler step,
and the next generate gives the tokens a fresh engine gives (the reference). Tiny random-weight Llama
from tests/conftest.py.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from pagellm import LLM, EngineArgs, SamplingParams  # noqa: E402
from pagellm.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError  # noqa: E402
from pagellm.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from pagellm.engine.llm_engine import LLMEngine  # noqa: E402
from pagellm.engine.output_processor import RequestState  # noqa: E402
from pagellm.engine.step_recovery import EngineRecoveryError  # noqa: E402
from pagellm.inputs import InputProcessor  # noqa: E402
from pagellm.spec_decode import BaseProposer  # noqa: E402

PROMPTS = [[5 + i, 17, 40 + i, 9, 23, 60 + 3 * i] for i in range(4)]
MAX_TOKENS = 6


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def seeded_n2() -> SamplingParams:
    return SamplingParams(n=2, seed=7, temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_llm(path, **kw) -> LLM:
    kw.setdefault("max_model_len", 128)
    return LLM(str(path), seed=0, **kw)


def run_batch(llm: LLM, params: SamplingParams | None = None, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params or greedy(), use_tqdm=False)


def run_batch_cumulative(llm: LLM, params: SamplingParams | None = None, prompts=PROMPTS):
    """run_batch through the engine's own step loop with CUMULATIVE outputs (an output after every step): LLM.generate
    asks for FINAL_ONLY, so there no output is built before a request finishes."""
    eng = llm.llm_engine
    ids = [f"cumulative-{i}-{id(prompts)}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p}, params or greedy())
    finished = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[i] for i in ids]


def tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def assert_idle(engine: LLMEngine) -> None:
    """No request left in Python or C++, no pending step, every KV block free."""
    assert not engine.has_unfinished_requests()
    assert not engine.output_processor.seq_to_req and not engine._generators
    sched = engine.scheduler
    assert not sched.has_unfinished_requests() and sched.num_waiting == 0 and sched.num_running == 0
    assert not sched.has_pending_step
    assert sched.num_free_blocks == sched.num_blocks


def raise_on_call(monkeypatch, obj, name: str, exc: BaseException, call: int = 1, times: int = 1) -> None:
    """obj.name raises `exc` on calls call .. call + times - 1 and behaves normally otherwise."""
    real = getattr(obj, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if call <= calls[0] < call + times:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)


class RepeatLastProposer(BaseProposer):
    """Drafts the last token k times (often rejected: exercises spec rows); raises on call `fail_on`."""

    def __init__(self, k: int = 2, fail_on: int | None = None) -> None:
        super().__init__(k)
        self.fail_on, self.calls = fail_on, 0

    def propose(self, requests):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("injected proposer failure")
        return {r.seq_id: [r.token_ids[-1]] * min(self.num_speculative_tokens, r.max_num_drafts) for r in requests}


class SchedulerProxy:
    """The engine's C++ scheduler with Python-patchable methods (pybind objects take no attributes)."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """What a fresh engine generates: greedy for every prompt, seeded n=2 for the first."""
    fresh = make_llm(tiny_llama_dir)
    return {"greedy": tokens(run_batch(fresh)), "seeded": tokens(run_batch(fresh, seeded_n2(), PROMPTS[:1]))}


def assert_failed_then_usable(llm: LLM, outs, reference, match: str, last_step: bool = False) -> None:
    """Every output of the batch failed with `match`, kept a prefix of the reference (a proper one unless the
    failure was in the batch's last step), and the engine recovered: idle, and the next batch equals a fresh
    engine's."""
    for out, ref in zip(outs, reference["greedy"]):
        assert out.finished and out.error is not None and match in out.error
        got = out.outputs[0].token_ids
        assert got == ref[0][: len(got)]
        # a failure in the last step finds the sequences finished by length already (error set, reason kept)
        assert (len(got) < MAX_TOKENS and out.outputs[0].finish_reason == "error") or \
            (last_step and out.outputs[0].finish_reason in ("error", "length"))
    assert_idle(llm.llm_engine)
    assert tokens(run_batch(llm)) == reference["greedy"]
    assert_idle(llm.llm_engine)


# ------------------------------------------------------------------------------------ item 7: faults in step()
FAULTS = {  # where the exception is raised, from which call on (a later step: some tokens exist already), how often
    "model": lambda eng: (eng.executor, "execute_model", 2, 1),
    "sampler": lambda eng: (eng.sampler, "forward", 2, 1),  # run with the greedy head off: the sampler's argmax
    "greedy head": lambda eng: (eng.model, "compute_greedy_token_ids", 2, 1),
    "detokenizer": lambda eng: (IncrementalDetokenizer, "update", len(PROMPTS) + 2, 1),  # mid-way through a step
    # after the scheduler's update; these two run CUMULATIVE requests (run_batch_cumulative), so outputs are built
    # every step
    "outputs": lambda eng: (RequestState, "make_output", len(PROMPTS) + 2, 1),
    "outputs_always": lambda eng: (RequestState, "make_output", len(PROMPTS) + 2, 10**9),  # error outputs too
    # LLM.generate's FINAL_ONLY requests: outputs are built in the last step only; its second one raises
    "final outputs": lambda eng: (RequestState, "make_output", 2, 1),
}


@pytest.mark.parametrize("stage", sorted(FAULTS))
def test_fault_in_step_fails_its_requests_and_engine_stays_usable(llm, reference, monkeypatch, stage):
    assert_idle(llm.llm_engine)
    obj, name, call, times = FAULTS[stage](llm.llm_engine)
    raise_on_call(monkeypatch, obj, name, RuntimeError(f"injected {stage} failure"), call, times)
    if stage == "sampler":  # plain-greedy steps otherwise take the LM head's fused argmax, not the sampler
        monkeypatch.setattr(llm.llm_engine, "greedy_head", False)
    outs = run_batch_cumulative(llm) if stage.startswith("outputs") else run_batch(llm)
    monkeypatch.undo()
    assert_failed_then_usable(llm, outs, reference, f"injected {stage} failure", last_step=stage == "final outputs")


@pytest.mark.parametrize("stage", ["sampler verify", "argmax verify"])
def test_fault_in_speculative_step(llm, reference, monkeypatch, stage):
    """A verify step that raises: through the sampler (greedy head off), or from the fused head's argmax rows."""
    eng = llm.llm_engine
    eng.set_proposer(RepeatLastProposer())
    try:
        if stage == "sampler verify":  # plain-greedy verify steps otherwise verify from the head's argmax rows
            monkeypatch.setattr(eng, "greedy_head", False)
            raise_on_call(monkeypatch, eng.sampler, "verify", RuntimeError("injected verify failure"))
        else:
            raise_on_call(monkeypatch, eng, "_verify_from_argmax", RuntimeError("injected verify failure"))
        outs = run_batch(llm)
        monkeypatch.undo()
        assert_failed_then_usable(llm, outs, reference, "injected verify")
    finally:
        eng.set_proposer(None)


def test_raising_proposer_costs_drafts_not_requests(llm, reference):
    """A proposer that raises (engine/spec_step.py): that step runs without drafts, nothing fails."""
    eng = llm.llm_engine
    eng.set_proposer(RepeatLastProposer(fail_on=1))
    try:
        outs = run_batch(llm)
        assert all(o.error is None for o in outs) and tokens(outs) == reference["greedy"]
        assert eng.spec_stats.num_proposer_errors == 1 and eng.spec_stats.num_draft_tokens > 0
        assert_idle(eng)
    finally:
        eng.set_proposer(None)


def test_fault_after_forks_closes_the_pending_step(llm, reference, monkeypatch):
    """n=2: the children are forked into the pending step before update() raises."""
    eng = llm.llm_engine
    monkeypatch.setattr(eng, "scheduler", SchedulerProxy(eng.scheduler))
    raise_on_call(monkeypatch, eng.scheduler, "update", RuntimeError("injected update failure"))
    out = run_batch(llm, seeded_n2(), PROMPTS[:1])[0]
    monkeypatch.undo()
    assert out.finished and "injected update failure" in out.error
    assert [c.finish_reason for c in out.outputs] == ["error", "error"]
    assert_idle(eng)
    assert tokens(run_batch(llm, seeded_n2(), PROMPTS[:1])) == reference["seeded"]


def test_fault_fails_only_the_requests_of_that_step(tiny_llama_dir, reference, monkeypatch):
    two_seqs = make_llm(tiny_llama_dir, max_num_seqs=2)  # the first step holds PROMPTS[0:2] only
    raise_on_call(monkeypatch, two_seqs.llm_engine.executor, "execute_model", RuntimeError("injected"), call=1)
    outs = run_batch(two_seqs)
    assert [o.error is not None for o in outs] == [True, True, False, False]
    assert [o.outputs[0].token_ids for o in outs[:2]] == [[], []]
    assert tokens(outs[2:]) == reference["greedy"][2:]
    assert_idle(two_seqs.llm_engine)


@pytest.mark.parametrize("where", ["inside_step", "between_steps"])
def test_keyboard_interrupt_in_generate_leaves_llm_usable(llm, reference, monkeypatch, where):
    eng = llm.llm_engine
    if where == "inside_step":  # used to leave the scheduler waiting for update() forever
        raise_on_call(monkeypatch, eng.executor, "execute_model", KeyboardInterrupt(), call=3)
    else:
        raise_on_call(monkeypatch, eng, "step", KeyboardInterrupt(), call=3)
    with pytest.raises(KeyboardInterrupt):
        run_batch(llm)
    monkeypatch.undo()
    assert_idle(eng)
    assert tokens(run_batch(llm)) == reference["greedy"]


def test_unrecoverable_step_raises(llm, monkeypatch):
    eng = llm.llm_engine
    raise_on_call(monkeypatch, eng.executor, "execute_model", RuntimeError("injected"))
    monkeypatch.setattr(eng, "scheduler", SchedulerProxy(eng.scheduler))
    raise_on_call(monkeypatch, eng.scheduler, "abort_pending_step", RuntimeError("cleanup broken"))
    eng.add_request("doomed", PROMPTS[0], greedy())
    with pytest.raises(EngineRecoveryError, match="cleanup broken"):
        eng.step()
    monkeypatch.undo()
    eng.abort_request("doomed")
    eng.scheduler.abort_pending_step()
    assert_idle(eng)


# ------------------------------------------------------------------------------------ item 7: bad input
def test_logprobs_above_max_logprobs_are_refused(llm, tiny_tokenizer):
    eng = llm.llm_engine
    assert eng.max_logprobs == 20  # vLLM's default
    for bad in (dict(logprobs=10**6), dict(logprobs=21), dict(prompt_logprobs=21)):
        with pytest.raises(ValueError, match="max_logprobs=20"):
            llm.generate(PROMPTS[0], greedy(**bad), use_tqdm=False)
        assert_idle(eng)
    out = llm.generate(PROMPTS[0], greedy(logprobs=20), use_tqdm=False)[0]
    assert all(len(d) >= 20 for d in out.outputs[0].logprobs)
    vocab = len(tiny_tokenizer)
    unlimited = InputProcessor(tiny_tokenizer, vocab, 64, max_logprobs=-1)  # -1: the vocabulary size
    assert unlimited.process([5], SamplingParams(logprobs=vocab)).params.logprobs == vocab
    with pytest.raises(ValueError, match="max_logprobs"):
        unlimited.process([5], SamplingParams(logprobs=vocab + 1))
    assert EngineArgs(max_logprobs=-1).create_engine_config().model_config.max_logprobs == -1
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineArgs(max_logprobs=-2).create_engine_config()


@pytest.mark.parametrize("kwargs,error,field", [
    (dict(stop=["x"] * 65), ValueError, "stop"), (dict(stop=["y" * 1025]), ValueError, "stop"),
    (dict(stop=5), TypeError, "stop"), (dict(stop_token_ids="12"), TypeError, "stop_token_ids"),
    (dict(ignore_eos="yes"), ValueError, "ignore_eos"), (dict(detokenize=1), ValueError, "detokenize"),
    (dict(logit_bias={"x": 1.0}), TypeError, "logit_bias"),
    (dict(logit_bias={1: float("nan")}), ValueError, "logit_bias"),
    (dict(logit_bias=[(1, 2.0)]), TypeError, "logit_bias"), (dict(logit_bias={1: 2**1100}), ValueError, "logit_bias"),
    (dict(top_k=2**63), ValueError, "top_k"), (dict(max_tokens=1.5), ValueError, "max_tokens"),
    (dict(temperature=2**1100), ValueError, "temperature"), (dict(n=2**63), ValueError, "n"),
])
def test_every_field_is_range_checked(kwargs, error, field):
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


def test_normalized_forms():
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0}  # JSON keys are strings
    assert SamplingParams(temperature=1e-3).temperature == 0.01  # as vLLM: tiny temperatures would overflow
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    p = SamplingParams()
    p.stop = "late"  # set after construction: the processor's _verify normalizes its clone
    p._verify()
    assert p.stop == ["late"]


def test_engine_limits_are_checked_by_the_processor(llm, tiny_tokenizer):
    vocab = len(tiny_tokenizer)
    cases = [(greedy(stop_token_ids=[vocab]), "stop_token_ids"), (greedy(logit_bias={vocab: 1.0}), "logit_bias"),
             (SamplingParams(n=llm.llm_engine.max_num_seqs + 1), "max_num_seqs")]
    for params, field in cases:
        with pytest.raises(ValueError, match=field):
            llm.generate(PROMPTS[0], params, use_tqdm=False)
        assert_idle(llm.llm_engine)


def test_failed_add_request_is_never_left_behind(llm, reference, monkeypatch):
    eng = llm.llm_engine
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**70)
    huge_seed = greedy()
    huge_seed.seed = 2**70  # set after construction: refused by the engine's input processor
    with pytest.raises(ValueError, match="seed"):
        llm.generate(PROMPTS[0], huge_seed, use_tqdm=False)
    assert_idle(eng)
    # a failure after the scheduler registered the request is rolled back too
    raise_on_call(monkeypatch, eng.output_processor, "add_request", RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        eng.add_request("half", PROMPTS[0], greedy())
    monkeypatch.undo()
    assert_idle(eng)
    outs = llm.generate({"prompt_token_ids": PROMPTS[1]}, greedy(), use_tqdm=False)
    assert len(outs) == 1 and tokens(outs) == reference["greedy"][1:2]


# ------------------------------------------------------------------------------------ item 1: seeds, AsyncLLM
@pytest.mark.parametrize("n,seed,ok", [(1, 2**64 - 1, True), (2, 2**64 - 2, True), (2, 2**64 - 1, False),
                                       (1, 2**64, False), (1, 2**63, True), (1, -1, False), (1, True, False)])
def test_seed_range_covers_every_child(n, seed, ok):
    if ok:
        assert SamplingParams(n=n, seed=seed).seed == seed
    else:
        with pytest.raises(ValueError, match=r"seed must be None or an integer in \[0, 2\*\*64 - n\]"):
            SamplingParams(n=n, seed=seed)


def _consume(front: AsyncLLM, prompt, params, request_id=None):
    async def run():
        return [o async for o in front.generate({"prompt_token_ids": prompt}, params, request_id)]
    return run()


def test_async_out_of_range_seed_is_refused_and_the_loop_lives(llm, reference):
    bad_child_seed = SamplingParams(n=2, max_tokens=4)
    bad_child_seed.seed = 2**64 - 1  # child 1 would be seeded 2**64
    huge_seed = SamplingParams(max_tokens=4)
    huge_seed.seed = 2**70
    front = AsyncLLM(llm.llm_engine)

    async def main():
        for params in (bad_child_seed, huge_seed):
            with pytest.raises(ValueError, match="seed"):
                await _consume(front, PROMPTS[0], params)
        return (await _consume(front, PROMPTS[0], greedy()))[-1]

    try:
        final = asyncio.run(main())
    finally:
        front.shutdown()
    assert not front.errored and front.dead_error is None
    assert tokens([final]) == reference["greedy"][:1]
    assert_idle(llm.llm_engine)


def test_async_step_fault_fails_that_request_and_the_loop_goes_on(llm, reference, monkeypatch):
    raise_on_call(monkeypatch, llm.llm_engine.executor, "execute_model", RuntimeError("injected model failure"), 2)
    front = AsyncLLM(llm.llm_engine)

    async def main():
        with pytest.raises(EngineStepError, match="injected model failure") as failed:
            await _consume(front, PROMPTS[0], greedy(), "a")
        assert failed.value.output.finished and failed.value.output.outputs[0].finish_reason == "error"
        await front.check_health()  # still healthy
        return (await _consume(front, PROMPTS[0], greedy(), "b"))[-1]

    try:
        final = asyncio.run(main())
    finally:
        front.shutdown()
    assert not front.errored
    assert tokens([final]) == reference["greedy"][:1]
    assert_idle(llm.llm_engine)


def test_async_unrecoverable_engine_marks_itself_dead(tiny_llama_dir, monkeypatch):
    engine = LLMEngine.from_engine_args(model=str(tiny_llama_dir), max_model_len=128)
    raise_on_call(monkeypatch, engine, "step", EngineRecoveryError("cannot recover"))
    front = AsyncLLM(engine)

    async def main():
        with pytest.raises(EngineDeadError, match="cannot recover"):
            await _consume(front, PROMPTS[0], greedy())
        assert front.errored and isinstance(front.dead_error, EngineDeadError)
        with pytest.raises(EngineDeadError):
            await front.check_health()  # what a server's /health turns into 503
        with pytest.raises(EngineDeadError):
            await _consume(front, PROMPTS[0], greedy())

    try:
        asyncio.run(main())
    finally:
        front.shutdown()
