"""long_prefill_token_threshold (vLLM's name): one request's prefill chunk is capped at that many tokens, the
output is unchanged, bad values are refused at construction, and `pagellm serve` passes the flag on."""

from __future__ import annotations

import math

import pytest

from pagellm import LLM, SamplingParams
from pagellm.config import SchedulerConfig

pytest.importorskip("pagellm._C", reason="needs the C++ scheduler (make install)")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    (dict(long_prefill_token_threshold=2.5), "long_prefill_token_threshold"),
    (dict(long_prefill_token_threshold=8, enable_chunked_prefill=False, max_num_batched_tokens=8192),
     "without chunked prefill"),
])
def test_bad_values_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_chunk_size_for_kv_sizing():
    assert SchedulerConfig(max_num_batched_tokens=512).max_prefill_chunk_tokens == 512
    assert SchedulerConfig(max_num_batched_tokens=512, long_prefill_token_threshold=64).max_prefill_chunk_tokens == 64
    assert SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=64).max_prefill_chunk_tokens == 32


def _steps_to_first_token(llm: LLM, prompt: list[int]) -> tuple[int, list[int]]:
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt}, GREEDY)
    steps, first, tokens = 0, None, []
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.outputs[0].token_ids and first is None:
                first = steps
            tokens = list(out.outputs[0].token_ids)
    return first, tokens


def test_prefill_is_chunked_and_output_unchanged(tiny_llama_dir):
    prompt = [(7 * i) % 300 + 3 for i in range(30)]
    plain = LLM(str(tiny_llama_dir), num_kv_blocks=32, max_model_len=128)
    chunked = LLM(str(tiny_llama_dir), num_kv_blocks=32, max_model_len=128, long_prefill_token_threshold=8)
    assert chunked.llm_engine.config.scheduler_config.long_prefill_token_threshold == 8
    steps_plain, tokens_plain = _steps_to_first_token(plain, prompt)
    steps_chunked, tokens_chunked = _steps_to_first_token(chunked, prompt)
    assert steps_plain == 1 and steps_chunked == math.ceil(len(prompt) / 8)
    assert tokens_chunked == tokens_plain


def test_serve_flag_reaches_the_engine_args():
    import argparse

    from pagellm.entrypoints.serve import add_serve_args, engine_kwargs

    args = add_serve_args(argparse.ArgumentParser()).parse_args(["model-dir", "--long-prefill-token-threshold", "256"])
    assert engine_kwargs(args)["long_prefill_token_threshold"] == 256
