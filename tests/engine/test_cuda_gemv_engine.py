"""The engine on device="cuda" in bf16 with its decode linears on linear_gemv (kernels 2 and 4, docs/cuda.md):
CUDA-graph replay with PDL gives the eager run's greedy tokens without PDL (the same kernels; PDL changes no bits),
and a prompt alone gives the tokens it gives inside a batch of six (the GEMV's bits do not depend on M; prompts of
15-17 tokens, whose prefill runs cuBLAS alone and batched, as in tools/gpu/engine_check.py's bf16 check)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW = 16
LENS = [3, 15, 16, 17, 40, 70]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer):
    from tiny_models import write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("llama64-gemv"), tiny_tokenizer, hidden_size=256, num_heads=4,
                            num_kv_heads=2)
    rng = random.Random(1)
    return path, [[rng.randrange(5, len(tiny_tokenizer)) for _ in range(n)] for n in LENS]


def _tokens(path, prompts, eager):
    from pagellm import LLM, SamplingParams

    llm = LLM(str(path), device="cuda", dtype="bfloat16", enforce_eager=eager, max_model_len=256, seed=0,
              kv_cache_memory_gb=0.25)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    batched = [list(o.outputs[0].token_ids) for o in
               llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    alone = [list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
             for p in prompts[1:4]]
    graphs = llm.llm_engine.executor.driver_worker.runner.cuda_graphs
    return batched, alone, (graphs.captured_buckets if graphs is not None else None)


@pytest.mark.parametrize("kernel,pdl", [(2, True), (4, True)])
def test_gemv_pdl_graphs_match_eager_and_alone_matches_batched(setup, monkeypatch, kernel, pdl):
    from pagellm.ops import linear_dispatch

    path, prompts = setup
    monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_MAX_M", 8)
    monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_KERNEL", kernel)
    monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_PDL", False)
    eager_batched, eager_alone, _ = _tokens(path, prompts, eager=True)
    monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_PDL", pdl)
    batched, alone, buckets = _tokens(path, prompts, eager=False)
    assert buckets and 1 in buckets and 8 in buckets  # the decode steps ran as graphs (batch 1 and 6 -> bucket 8)
    assert batched == eager_batched
    assert alone == eager_alone == batched[1:4]
