"""Pipeline micro-batches (PP=2 over "mp", gloo on CPU): two steps in flight over disjoint requests, against
one rank in process on tiny random checkpoints. Greedy tokens identical, prompt and sampled logprobs within
1e-5 (float32), with many requests of different lengths, shared prefixes (prefix caching on) and a KV cache
small enough to preempt; a request aborted while its step is in flight; a step that fails in flight fails
only its requests; pipeline_microbatching=False keeps one step at a time. No leaked KV block in any case.
"""

from __future__ import annotations

import os

import pytest

from parallel_helpers import (  # noqa: F401  (bounded_waits: an autouse fixture)
    assert_pipeline_drained,
    assert_same_request,
    bounded_waits,
    run_requests,
    write_pp_llama,
    write_pp_qwen3,
)
from pagellm import LLM, SamplingParams
from pagellm.config import ParallelConfig

pytest.importorskip("pagellm._C", reason="the engine needs the compiled scheduler (run `make install`)")

BASE = list(range(30, 62))  # two blocks of 16: a prefix several prompts share
PROMPTS = [BASE + [5, 6, 7], BASE + [9] * 20, [7, 280, 3, 3, 41], list(range(100, 161)), BASE[:16] + [1, 2, 3],
           [11, 11, 11], BASE + [5, 6, 7, 8], list(range(200, 240))]
TINY_CACHE = 14  # blocks of 16: the eight requests need more at once, so some are preempted


def _params(i: int) -> SamplingParams:
    """Different lengths; prompt logprobs on every third request (those stay off the prefix cache)."""
    return SamplingParams(temperature=0, max_tokens=5 + (3 * i) % 13, ignore_eos=True, logprobs=0,
                          prompt_logprobs=0 if i % 3 == 0 else None, detokenize=False)


def _llm(path, pp: int = 1, num_kv_blocks: int = 64, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", num_kv_blocks=num_kv_blocks, max_model_len=128, block_size=16,
               pipeline_parallel_size=pp, enable_prefix_caching=True, **kwargs)


def _all_requests() -> dict:
    return {f"r{i}": (p, _params(i)) for i, p in enumerate(PROMPTS)}


class _RecordingScheduler:
    """Forwards to the C++ scheduler; remembers which requests schedule() preempted."""

    def __init__(self, scheduler) -> None:
        self._scheduler = scheduler
        self.preempted: list[str] = []

    def schedule(self):
        out = self._scheduler.schedule()
        self.preempted += list(out.preempted_request_ids)
        return out

    def __getattr__(self, name):
        return getattr(self._scheduler, name)


def _record_in_flight(engine, monkeypatch) -> list[int]:
    """Wraps engine._submit: the list gets the number of steps in flight after each submit."""
    seen: list[int] = []
    submit = engine._submit

    def recording(sched_out, seq_ids):
        step = submit(sched_out, seq_ids)
        seen.append(len(engine._batch_queue) + 1)
        return step

    monkeypatch.setattr(engine, "_submit", recording)
    return seen


def _assert_idle_and_empty(engine) -> None:
    assert_pipeline_drained(engine)
    assert engine.executor.broken_error is None


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory, tiny_tokenizer):
    return write_pp_llama(tmp_path_factory.mktemp("ppmb"), tiny_tokenizer)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tiny_tokenizer):
    return write_pp_qwen3(tmp_path_factory.mktemp("ppmb"), tiny_tokenizer)


@pytest.fixture(scope="module")
def llama_reference(llama4_dir):
    llm = _llm(llama4_dir)
    return run_requests(llm.llm_engine, _all_requests())


@pytest.fixture(scope="module")
def llama_pp2(llama4_dir):
    """PP=2 with micro-batches and a tiny KV cache, shared by the tests below (each leaves it idle)."""
    llm = _llm(llama4_dir, pp=2, num_kv_blocks=TINY_CACHE)
    yield llm
    llm.shutdown()
    assert all(p.exitcode is not None for p in llm.llm_engine.executor.procs)


@pytest.mark.parametrize("fixture", ["llama4_dir", "qwen3_dir"])
def test_two_micro_batches_in_flight_match_one_rank(fixture, request, llama_pp2, monkeypatch):
    path = request.getfixturevalue(fixture)
    if fixture == "llama4_dir":
        ref = request.getfixturevalue("llama_reference")
    else:
        ref = run_requests(_llm(path).llm_engine, _all_requests())
    llm = llama_pp2 if fixture == "llama4_dir" else _llm(path, pp=2, num_kv_blocks=TINY_CACHE)
    try:
        engine = llm.llm_engine
        assert engine.executor.max_concurrent_batches == 2 and engine.scheduler.max_steps_in_flight == 2
        recorder = _RecordingScheduler(engine.scheduler)
        monkeypatch.setattr(engine, "scheduler", recorder)
        in_flight = _record_in_flight(engine, monkeypatch)
        hits = engine.scheduler.prefix_cache_hits
        got = run_requests(engine, _all_requests())
        hits = engine.scheduler.prefix_cache_hits - hits
        monkeypatch.undo()
        assert sorted(got) == sorted(ref)
        for rid in ref:
            assert_same_request(ref[rid], got[rid])
        assert max(in_flight) == 2  # the stages did run two steps at once
        assert recorder.preempted  # the tiny cache preempted (never a request in flight: the C++ test)
        assert hits > 0  # prefix caching served blocks (shared prefixes, preempted requests' own blocks)
        _assert_idle_and_empty(engine)
    finally:
        if llm is not llama_pp2:
            llm.shutdown()


def test_abort_while_in_flight_skips_its_row_and_frees_its_blocks(llama_pp2, llama_reference):
    engine = llama_pp2.llm_engine
    requests = _all_requests()
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    assert engine.step() == [] and engine.num_steps_in_flight == 1  # the first micro-batch is submitted
    first = engine._batch_queue[0].seq_ids[0]
    assert engine.scheduler.get_request(first).in_flight
    engine.abort_request(first)  # its blocks are freed now; the step still runs on the stages
    pids = engine.collective_rpc(_pid)  # a call between steps: its replies come after the step in flight's
    assert len(set(pids)) == 2 and os.getpid() not in pids
    outputs = engine.step()  # submits the second micro-batch, collects the first without `first`
    assert first not in [o.request_id for o in outputs]
    while engine.num_steps_in_flight == 0:
        assert first not in [o.request_id for o in engine.step()]
    second = engine._batch_queue[0].seq_ids[0]
    engine.abort_request(second)
    engine.add_request(second, {"prompt_token_ids": requests[second][0]}, requests[second][1])  # the id again
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != first
            if out.finished:
                final[out.request_id] = out
    assert sorted(final) == sorted(rid for rid in requests if rid != first)
    for rid, out in final.items():  # the re-added request ran from scratch, like the others
        assert_same_request(llama_reference[rid], out)
    _assert_idle_and_empty(engine)


def _first_step_fails(engine, requests: dict, message: str, reference: dict) -> list[str]:
    """Adds `requests`, runs until all finish; the first step submitted (the oldest in the queue) fails: its requests
    end with `message` in their error, every other request equals `reference`, nothing is left in flight. Returns
    the failed step's request ids."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    engine.step()
    doomed = list(engine._batch_queue[0].seq_ids)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert sorted(final) == sorted(requests)
    for rid, out in final.items():
        if rid in doomed:
            assert message in out.error
        else:
            assert_same_request(reference[rid], out)
    _assert_idle_and_empty(engine)
    return doomed


def test_a_failed_step_in_flight_fails_only_its_requests(llama_pp2, llama_reference, monkeypatch):
    engine = llama_pp2.llm_engine
    sample, calls = engine._sample, []

    def failing_once(logits, rows, logit_rows):
        calls.append(len(rows))
        if len(calls) == 1:
            raise RuntimeError("sampler exploded")
        return sample(logits, rows, logit_rows)

    monkeypatch.setattr(engine, "_sample", failing_once)
    requests = _all_requests()
    doomed = _first_step_fails(engine, requests, "sampler exploded", llama_reference)
    assert len(doomed) < len(requests)  # the other micro-batch's requests went on
    monkeypatch.undo()
    again = run_requests(engine, {"r3": requests["r3"]})  # the engine stays usable
    assert_same_request(llama_reference["r3"], again["r3"])
    _assert_idle_and_empty(engine)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_step_failing_on_a_stage_fails_only_its_requests(stage, llama_pp2, llama_reference):
    """The stage raises before its activations moved: it still receives / sends them (zeros), so the other
    stage stays at the same step; the step's requests fail, the executor is not broken, the rest go on."""
    engine = llama_pp2.llm_engine
    engine.collective_rpc(_fail_next_step_on_stage, (stage,))
    _first_step_fails(engine, _all_requests(), f"stage {stage} exploded", llama_reference)


def test_n2_children_fork_into_the_step_in_flight(llama_pp2, llama4_dir):
    """n > 1: the children are forked into the oldest step when it is collected; seeded sampling gives the
    same tokens as one rank (each sequence has its own generator)."""
    requests = {"n2": (PROMPTS[1], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, detokenize=False)),
                **{f"r{i}": (PROMPTS[i], _params(i)) for i in (2, 3, 5)}}
    ref = run_requests(_llm(llama4_dir).llm_engine, requests)
    got = run_requests(llama_pp2.llm_engine, requests)
    assert [c.token_ids for c in got["n2"].outputs] == [c.token_ids for c in ref["n2"].outputs]
    assert len(got["n2"].outputs) == 2
    for rid in ("r2", "r3", "r5"):
        assert_same_request(ref[rid], got[rid])
    _assert_idle_and_empty(llama_pp2.llm_engine)


def test_async_llm_streams_and_aborts_over_micro_batches(llama_pp2, llama_reference):
    """The server's front: concurrent streams over PP=2 micro-batches, one stream closed early (an abort,
    possibly while its step is in flight); the others end as on one rank."""
    import asyncio

    from pagellm.engine.async_llm import AsyncLLM

    front = AsyncLLM(llama_pp2.llm_engine)
    requests = _all_requests()

    async def consume(rid: str, stop_after: int | None = None):
        last = None
        ids, params = requests[rid]
        async for out in front.generate({"prompt_token_ids": ids}, params, request_id=rid):
            last = out
            if stop_after is not None and len(out.outputs[0].token_ids) >= stop_after:
                break  # closing the generator aborts the request
        return rid, last

    async def main():
        return await asyncio.gather(*(consume(rid, 2 if rid == "r1" else None) for rid in requests))

    try:
        results = dict(asyncio.run(main()))
    finally:
        front.shutdown()
    assert not front.errored and front.dead_error is None
    assert not results["r1"].finished
    for rid, out in results.items():
        if rid != "r1":
            assert_same_request(llama_reference[rid], out)
    engine = llama_pp2.llm_engine
    while engine.has_unfinished_requests():  # a step of the aborted stream may still be in flight
        engine.step()
    _assert_idle_and_empty(engine)


def test_microbatching_off_runs_one_step_at_a_time(llama4_dir, llama_reference):
    llm = _llm(llama4_dir, pp=2, num_kv_blocks=TINY_CACHE, pipeline_microbatching=False)
    try:
        engine = llm.llm_engine
        assert engine.executor.max_concurrent_batches == 1 and engine.scheduler.max_steps_in_flight == 1
        assert engine._batch_queue is None
        got = run_requests(engine, _all_requests())
        for rid, out in got.items():
            assert_same_request(llama_reference[rid], out)
        _assert_idle_and_empty(engine)
    finally:
        llm.shutdown()


def test_pipeline_microbatching_option_is_checked():
    with pytest.raises(ValueError, match="pipeline_microbatching"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_microbatching="no")
    import argparse

    from pagellm.distributed.cli_args import add_parallel_args, parallel_engine_kwargs

    p = argparse.ArgumentParser()
    add_parallel_args(p)
    assert parallel_engine_kwargs(p.parse_args(["-pp", "2", "--no-pipeline-microbatching"])) == {
        "pipeline_parallel_size": 2, "pipeline_microbatching": False}
    assert "pipeline_microbatching" not in parallel_engine_kwargs(p.parse_args(["-pp", "2"]))


def _pid(worker):
    return os.getpid()


def _fail_next_step_on_stage(worker, stage: int) -> None:
    """On pipeline stage `stage`: the next step raises before the model runs (so before any activation moves)."""
    from pagellm.distributed import get_pp_state

    if get_pp_state().rank != stage:
        return
    execute = worker.runner.execute

    def failing(*args, **kwargs):
        worker.runner.execute = execute
        raise RuntimeError(f"stage {stage} exploded")

    worker.runner.execute = failing
