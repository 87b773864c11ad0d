"""Speculative methods that run on the target model itself (Medusa heads, a self-draft) are refused with
tensor_parallel_size > 1 while the configuration is built, before any model is opened or rank started; the
ones that do not (ngram, a separate draft checkpoint) are accepted."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from pagellm.config import EngineArgs
from pagellm.distributed.validation import check_speculative_tensor_parallel
from pagellm.spec_decode import SpeculativeConfig

SELF_DRAFT = {"method": "draft_model", "num_speculative_tokens": 2, "num_layers": 1}
MEDUSA = {"method": "medusa", "num_speculative_tokens": 2, "model": "/nonexistent/medusa-heads"}


@pytest.mark.parametrize("spec, what", [(SELF_DRAFT, "self-draft"), (MEDUSA, "Medusa")])
def test_target_sharing_methods_refused_under_tp(spec, what):
    with pytest.raises(ValueError, match=rf"{what}.*tensor_parallel_size=2.*'ngram'"):
        EngineArgs(model="unused", tensor_parallel_size=2, speculative_config=spec).create_engine_config(256)
    with pytest.raises(ValueError, match="tensor_parallel_size=4"):
        check_speculative_tensor_parallel(4, SpeculativeConfig.from_dict(spec))
    check_speculative_tensor_parallel(1, SpeculativeConfig.from_dict(spec))  # one rank: the target is in process
    config = EngineArgs(model="unused", speculative_config=spec).create_engine_config(256)
    assert config.speculative_config.method == spec["method"]


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {**SELF_DRAFT, "model": "/some/draft/checkpoint"}])
def test_methods_with_their_own_model_accepted_under_tp(spec):
    config = EngineArgs(model="unused", tensor_parallel_size=2, speculative_config=spec).create_engine_config(256)
    assert config.parallel_config.tensor_parallel_size == 2 and config.speculative_config.method == spec["method"]
    check_speculative_tensor_parallel(2, None)


def test_llm_refuses_before_any_rank_starts(tiny_llama_dir):
    pytest.importorskip("pagellm._C", reason="the engine needs the compiled scheduler (run `make install`)")
    from pagellm import LLM  # noqa: PLC0415

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="self-draft"):
        LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=128, tensor_parallel_size=2,
            speculative_config=SELF_DRAFT)
    assert time.monotonic() - t0 < 10 and not multiprocessing.active_children()
