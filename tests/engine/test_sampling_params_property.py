"""Property: any SamplingParams either is refused (ValueError / TypeError) at construction or by the engine's
input processor, before anything is registered, or its requests run to the end without an error.

Hypothesis draws either every field from its valid range and its edges (such params must run: seed near
2**64, logprobs = max_logprobs, tiny temperatures, huge penalties, ...) or fields mixed with junk (NaN, inf,
bools, strings, huge ints, ids outside the vocabulary). After
each example the engine must hold no request and every KV block must be free. Tiny random-weight Llama
with a short max_model_len, so max_tokens=None runs are short.
"""

from __future__ import annotations

import math

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (the [test] extra)")
pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagellm import LLM, SamplingParams  # noqa: E402

MAX_MODEL_LEN = 40
MAX_NUM_SEQS = 4
VOCAB = 320  # tests/conftest.py's tiny tokenizer (checked in the fixture)

_JUNK = st.sampled_from([math.nan, math.inf, -math.inf, True, "1", None, 2**70, -(2**70), 2**1100, 1.5, [1], {}])


def _or_junk(valid):
    return st.one_of(valid, valid, valid, _JUNK)  # mostly valid values, sometimes junk


def _floats(lo, hi, edges=()):
    return _or_junk(st.one_of(st.floats(lo, hi, allow_nan=False), st.sampled_from(list(edges) or [lo, hi])))


_TOKEN_IDS = st.integers(-2, VOCAB + 2)
FIELDS = {
    "n": _or_junk(st.integers(-1, MAX_NUM_SEQS + 1)),
    "temperature": _floats(-0.5, 3.0, [0.0, 1e-30, 1e-3, 0.01, 1e30]),
    "top_k": _or_junk(st.one_of(st.integers(-3, VOCAB + 5), st.sampled_from([0, 2**63 - 1, 2**63]))),
    "top_p": _floats(-0.5, 1.5, [0.0, 1e-9, 1.0]),
    "min_p": _floats(-0.5, 1.5, [0.0, 1.0]),
    "seed": _or_junk(st.one_of(st.integers(-3, 2**64 + 3), st.sampled_from([2**63, 2**64 - 4, 2**64 - 2, 2**64 - 1]))),
    "presence_penalty": _floats(-3.0, 3.0, [-2.0, 2.0]),
    "frequency_penalty": _floats(-3.0, 3.0, [-2.0, 2.0]),
    "repetition_penalty": _floats(-1.0, 5.0, [0.0, 1e-30, 1e30]),
    "logit_bias": _or_junk(st.dictionaries(st.one_of(_TOKEN_IDS, st.sampled_from(["7", "x", "-1"])),
                                           _floats(-150.0, 150.0, [-100.0, 100.0]), max_size=4)),
    "stop": _or_junk(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=4),
                               st.just(["x"] * 65), st.just(["y" * 1025]))),
    "stop_token_ids": _or_junk(st.lists(_TOKEN_IDS, max_size=3)),
    "include_stop_str_in_output": _or_junk(st.booleans()),
    "ignore_eos": _or_junk(st.booleans()),
    "skip_special_tokens": _or_junk(st.booleans()),
    "spaces_between_special_tokens": _or_junk(st.booleans()),
    "detokenize": _or_junk(st.booleans()),
    "max_tokens": _or_junk(st.integers(-1, MAX_MODEL_LEN)),
    "min_tokens": _or_junk(st.integers(-1, MAX_MODEL_LEN)),
    "logprobs": _or_junk(st.one_of(st.integers(-1, 25), st.just(10**6))),
    "prompt_logprobs": _or_junk(st.one_of(st.integers(-1, 25), st.just(10**6))),
    "logprobs_mode": st.sampled_from(["raw", "processed", "weird"]),
}


_FITTING_PROMPT_LEN = 8  # prompts are at most this long, so max_tokens <= MAX_MODEL_LEN - 8 always fits
VALID = {  # every field inside its allowed range, edges included: these must all run
    "n": st.integers(1, MAX_NUM_SEQS),
    "temperature": st.one_of(st.floats(0.0, 3.0), st.sampled_from([0.0, 1e-30, 1e-3, 0.01, 1e30])),
    "top_k": st.one_of(st.integers(-1, VOCAB + 5), st.sampled_from([0, 2**63 - 1])),
    "top_p": st.one_of(st.floats(0.0, 1.0, exclude_min=True), st.sampled_from([1e-9, 1.0])),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.one_of(st.none(), st.integers(0, 2**64 - MAX_NUM_SEQS), st.just(2**64 - MAX_NUM_SEQS)),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.one_of(st.floats(1e-3, 5.0), st.sampled_from([1e-30, 1e30])),
    "logit_bias": st.one_of(st.none(), st.dictionaries(
        st.one_of(st.integers(0, VOCAB - 1), st.sampled_from(["7", "19"])), st.floats(-100.0, 100.0), max_size=4)),
    "stop": st.one_of(st.none(), st.text(min_size=1, max_size=4),
                      st.lists(st.text(min_size=1, max_size=4), max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "max_tokens": st.one_of(st.none(), st.integers(1, MAX_MODEL_LEN - _FITTING_PROMPT_LEN)),
    "min_tokens": st.integers(0, 3),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "logprobs_mode": st.sampled_from(["raw", "processed"]),
}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tiny_tokenizer):
    assert len(tiny_tokenizer) == VOCAB
    return LLM(str(tiny_llama_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, seed=0).llm_engine


def _cross_field_conflict(kwargs) -> bool:
    """Valid fields refused together: min_tokens > max_tokens."""
    max_tokens = kwargs.get("max_tokens", 16)
    return max_tokens is not None and kwargs.get("min_tokens", 0) > max_tokens


def _assert_idle(engine) -> None:
    sched = engine.scheduler
    assert not engine.has_unfinished_requests() and not sched.has_unfinished_requests()
    assert not sched.has_pending_step and sched.num_free_blocks == sched.num_blocks


def _with_one_wild_field(kwargs: dict):
    """Valid kwargs with one field redrawn from FIELDS (junk or an edge only the engine can refuse)."""
    return st.sampled_from(sorted(FIELDS)).flatmap(lambda name: FIELDS[name].map(lambda v: {**kwargs, name: v}))


CASES = st.one_of(  # (must run?, kwargs)
    st.tuples(st.just(True), st.fixed_dictionaries({}, optional=VALID)),
    st.tuples(st.just(False), st.fixed_dictionaries({}, optional=VALID).flatmap(_with_one_wild_field)),
    st.tuples(st.just(False), st.fixed_dictionaries({}, optional=FIELDS)),
)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=CASES,
       prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=_FITTING_PROMPT_LEN),
                        min_size=1, max_size=2))
def test_any_sampling_params_is_refused_or_runs(engine, case, prompts):
    valid, kwargs = case
    valid = valid and not _cross_field_conflict(kwargs)  # then it must be accepted and run
    _assert_idle(engine)
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError):
        assert not valid, kwargs
        return
    added: list[str] = []
    try:
        _add_and_run(engine, params, prompts, added, valid)
    finally:  # a failed example must not leak requests into the next one
        engine.abort_request(added)
    _assert_idle(engine)


def _add_and_run(engine, params: SamplingParams, prompts, added: list[str], valid: bool) -> None:
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
            added.append(f"p{i}")
    except (ValueError, TypeError):  # refused before registration (a later, longer prompt may not fit)
        assert not valid, params
        engine.abort_request(added)
        _assert_idle(engine)
        return
    finals = {}
    for _ in range(10 * MAX_MODEL_LEN):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                finals[out.request_id] = out
    assert sorted(finals) == added
    for out in finals.values():
        assert len(out.outputs) == params.n
        assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
        if params.logprobs is not None:
            assert all(len(c.logprobs) == len(c.token_ids) for c in out.outputs)
