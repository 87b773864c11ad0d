"""Speculative decoding under pipeline parallelism (PP=2 over "mp", two micro-batches in flight) against one
rank in process without speculation, on a tiny random Llama (4 layers, float32): `ngram` and `draft_model`
with its own checkpoint (run in the driver) give greedy tokens identical to plain decoding, prompt logprobs
within 1e-5, with drafts really scored and some accepted; a request aborted while its spec step is in
flight gets nothing from it and leaks no block. Methods that run on the target model itself (Medusa, a
self-draft) are refused before any rank starts, naming the supported ones.
"""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest
import transformers as tf

from parallel_helpers import (  # noqa: F401  (bounded_waits: an autouse fixture)
    assert_pipeline_drained,
    assert_same_request,
    bounded_waits,
    run_requests,
    write_pp_llama,
    write_tiny_checkpoint,
)
from pagellm import LLM, SamplingParams
from pagellm.spec_decode.batch import SpecRows, keep_rows

pytest.importorskip("pagellm._C", reason="the engine needs the compiled scheduler (run `make install`)")

# repeats for ngram to find; different lengths so the micro-batches mix prefills, decodes and spec rows
PROMPTS = [[5, 6, 7, 8] * 4, list(range(20, 57)), [7, 300, 3, 3, 3, 41, 99, 250, 18], [11, 12, 13] * 5,
           list(range(100, 120)) + list(range(100, 110)), [42, 43] * 6]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}  # adaptive (default): no step time to judge by, drafts on


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=18 + 3 * i, ignore_eos=True, logprobs=0,
                          prompt_logprobs=0 if i % 2 == 0 else None, detokenize=False)


def _llm(path, pp: int = 1, speculative_config=None) -> LLM:
    return LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=256, block_size=16,
               pipeline_parallel_size=pp, speculative_config=speculative_config)


def _run(engine, on_step=None) -> dict:
    return run_requests(engine, {f"r{i}": (p, _params(i)) for i, p in enumerate(PROMPTS)}, on_step)


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory, tiny_tokenizer):
    return write_pp_llama(tmp_path_factory.mktemp("ppspec"), tiny_tokenizer)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tiny_tokenizer):
    """Two layers drawn like the target's first two (same seed), its own norm and head: drafts often right."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("ppspec") / "draft", tiny_tokenizer, tf.LlamaConfig, tf.LlamaForCausalLM,
        num_hidden_layers=2, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def reference(llama4_dir):
    return _run(_llm(llama4_dir).llm_engine)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_under_pp2_microbatches_matches_plain_decoding(method, llama4_dir, draft_dir, reference,
                                                                  monkeypatch):
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "num_speculative_tokens": 2, "adaptive": False,
                                           "model": str(draft_dir), "disable_by_batch_size": 64}
    llm = _llm(llama4_dir, pp=2, speculative_config=spec)
    try:
        engine = llm.llm_engine
        assert engine.executor.max_concurrent_batches == 2
        in_flight: list[int] = []  # steps in flight after each submit, and whether that step carried drafts
        submit = engine._submit

        def recording(sched_out, seq_ids):
            step = submit(sched_out, seq_ids)
            in_flight.append((len(engine._batch_queue) + 1, len(sched_out.draft_token_ids) > 0))
            return step

        monkeypatch.setattr(engine, "_submit", recording)
        got = _run(engine)
        assert sorted(got) == sorted(reference)
        for rid, ref in reference.items():
            assert_same_request(ref, got[rid])
        stats = engine.spec_stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_draft_tokens > 0  # drafts were verified
        if method == "ngram":  # adaptive: the switch never times a step under micro-batches, so never turns drafts off
            assert engine.spec_switch is not None and engine.spec_switch.num_switched_off == 0
        assert (2, True) in in_flight  # a step with drafts went in while another micro-batch was in flight
        assert_pipeline_drained(engine)
    finally:
        llm.shutdown()


def test_request_aborted_while_its_spec_step_is_in_flight(llama4_dir, reference):
    llm = _llm(llama4_dir, pp=2, speculative_config=NGRAM)
    aborted: list[str] = []

    def abort_a_spec_row(engine) -> None:
        if aborted:
            return
        for step in engine._batch_queue:
            rows = np.flatnonzero(step.sched_out.num_draft_tokens)
            if len(rows):
                aborted.append(step.seq_ids[int(rows[0])])
                engine.abort_request(aborted[0])
                return

    try:
        engine = llm.llm_engine
        got = _run(engine, on_step=abort_a_spec_row)
        assert len(aborted) == 1 and aborted[0] not in got
        assert sorted(got) == sorted(set(reference) - set(aborted))
        for rid, out in got.items():
            assert_same_request(reference[rid], out)
        assert_pipeline_drained(engine)
    finally:
        llm.shutdown()


def test_keep_rows_drops_rows_with_their_logits_and_drafts():
    split = SpecRows(plain_rows=np.array([0, 3]), plain_logit_rows=np.array([0, 5]), spec_rows=np.array([1, 4, 5]),
                     spec_logit_rows=np.array([1, 2, 3, 4, 6, 7, 8, 9]), draft_token_ids=[[9, 8], [], [7, 6, 5]])
    kept = keep_rows(split, np.array([True, True, False, False, False, True]))
    assert kept.plain_rows.tolist() == [0] and kept.plain_logit_rows.tolist() == [0]
    assert kept.spec_rows.tolist() == [1, 5] and kept.draft_token_ids == [[9, 8], [7, 6, 5]]
    assert kept.spec_logit_rows.tolist() == [1, 2, 3, 6, 7, 8, 9]


@pytest.mark.parametrize("spec, what", [
    ({"method": "draft_model", "num_speculative_tokens": 2, "num_layers": 1}, "self-draft"),
    ({"method": "medusa", "num_speculative_tokens": 2, "model": "/nonexistent/medusa-heads"}, "Medusa")])
def test_methods_on_the_target_model_refused_before_any_rank_starts(spec, what, llama4_dir):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=rf"{what}.*pipeline_parallel_size=2.*'ngram'.*'model'"):
        _llm(llama4_dir, pp=2, speculative_config=spec)
    assert time.monotonic() - t0 < 10 and not multiprocessing.active_children()
