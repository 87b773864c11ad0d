"""CUDA graphs for decode steps (engine/cuda_graphs.py): the buckets everywhere; on a GPU, graph replays give the
eager forward's tokens and logprobs at padded batch sizes, and enforce_eager turns graphs off."""

from __future__ import annotations

import random

import pytest
import torch

from pagellm.engine.cuda_graphs import MAX_CAPTURE_BATCH, bucket_for, capture_sizes


def test_capture_sizes_and_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(64) == [1, 2, 4, *range(8, 65, 8)]
    assert capture_sizes(100)[-2:] == [96, 104]  # the last bucket covers max_batch
    assert capture_sizes(10_000)[-1] == MAX_CAPTURE_BATCH
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket_for(65, sizes) is None
    with pytest.raises(ValueError, match="max_batch"):
        capture_sizes(0)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def llama64_dir(tmp_path_factory, tiny_tokenizer):
    """The tiny Llama with head_dim 64, the CUDA attention kernels' smallest head size."""
    from tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("llama64"), tiny_tokenizer, hidden_size=256, num_heads=4,
                            num_kv_heads=2)


def _run(path, prompts, eager: bool, dtype: str):
    from pagellm import LLM, SamplingParams

    llm = LLM(str(path), device="cuda", dtype=dtype, enforce_eager=eager, max_model_len=256, seed=0,
              kv_cache_memory_gb=0.25, max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runner = llm.llm_engine.executor.driver_worker.runner
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]
    return toks, lps, runner


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3, 9])  # buckets 1, 4 (padded), 16 (padded)
def test_graph_replay_equals_eager(llama64_dir, tiny_tokenizer, dtype, batch):
    rng = random.Random(batch)
    prompts = [[rng.randrange(5, len(tiny_tokenizer)) for _ in range(rng.randrange(3, 40))] for _ in range(batch)]
    eager_toks, eager_lps, eager_runner = _run(llama64_dir, prompts, True, dtype)
    graph_toks, graph_lps, graph_runner = _run(llama64_dir, prompts, False, dtype)
    assert eager_runner.cuda_graphs is None
    assert graph_runner.cuda_graphs is not None and graph_runner.cuda_graphs.num_captures >= 1
    # Padding rows change cuBLAS's M (3 -> 4, 9 -> 16), which may change its kernel and the last bits: the tokens
    # must agree, the logprobs to rounding.
    assert graph_toks == eager_toks
    tol = 1e-4 if dtype == "float32" else 3e-2
    for g_row, e_row in zip(graph_lps, eager_lps):
        for g, e in zip(g_row, e_row):
            assert g.keys() == e.keys()
            assert all(abs(g[t] - e[t]) <= tol for t in g), (g, e)
