"""The engine on device="cuda" with the fused decode kernels (ops/fused_dispatch.py and the C++ switch
PAGELLM_CUDA_FUSE_DECODE_REDUCE) against the same engine with every fusion off: the fused paths give the unfused bits,
so greedy tokens (and logprobs) are identical, eager and with CUDA graphs, in bf16 (norms and silu folded into the
decode GEMVs, rope with the cache write, the split merge in the decode kernel) and fp32 (rope + cache write and the
merge only: fp32 linears stay on cuBLAS). Prompts of 70-200 tokens, so the decode contexts split."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW = 12
LENS = [70, 130, 200, 3]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer):
    from tiny_models import write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("llama64-fused"), tiny_tokenizer, hidden_size=256, num_heads=4,
                            num_kv_heads=2, num_layers=3)
    rng = random.Random(2)
    return path, [[rng.randrange(5, len(tiny_tokenizer)) for _ in range(n)] for n in LENS]


def _set_fusions(monkeypatch, on: bool):
    from pagellm.ops import fused_dispatch

    for name in ("CUDA_FUSE_ROPE_CACHE", "CUDA_FUSE_NORM_GEMV", "CUDA_FUSE_ACT_GEMV"):
        monkeypatch.setattr(fused_dispatch, name, on)
    monkeypatch.setenv("PAGELLM_CUDA_FUSE_DECODE_REDUCE", "1" if on else "0")


def _generate(path, prompts, dtype, eager):
    from pagellm import LLM, SamplingParams

    llm = LLM(str(path), device="cuda", dtype=dtype, enforce_eager=eager, max_model_len=512, seed=0,
              kv_cache_memory_gb=0.25)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    alone = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    graphs = llm.llm_engine.executor.driver_worker.runner.cuda_graphs
    return ([list(o.token_ids) for o in alone], [[sorted(d.items()) for d in o.logprobs] for o in alone],
            graphs.captured_buckets if graphs is not None else None)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("eager", [True, False])
def test_fused_engine_gives_the_unfused_tokens(setup, monkeypatch, dtype, eager):
    from pagellm.ops import linear_dispatch

    path, prompts = setup
    monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_MAX_M", 1)  # single decode rows on linear_gemv (kernel 4)
    monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_KERNEL", 4)
    _set_fusions(monkeypatch, False)
    tokens_off, logprobs_off, _ = _generate(path, prompts, dtype, eager)
    _set_fusions(monkeypatch, True)
    tokens_on, logprobs_on, buckets = _generate(path, prompts, dtype, eager)
    if not eager:
        assert buckets and 1 in buckets  # the decode steps ran as graphs
    assert tokens_on == tokens_off
    assert logprobs_on == logprobs_off  # the same bits, so the same logprobs


def test_folds_happen_on_cuda_decode_rows(setup, monkeypatch):
    """The bf16 decode steps fold both norms and the activation into their GEMVs and run the rope with the cache write
    (the prefill step's many rows fold no norm, but its rope goes with the write too); nothing rotates apart."""
    from pagellm import LLM, SamplingParams
    from pagellm.attention import cuda_backend
    from pagellm.layers import folded
    from pagellm.layers.rotary import RotaryEmbedding
    from pagellm.ops import linear_dispatch

    path, prompts = setup
    monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_MAX_M", 1)
    monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_KERNEL", 4)
    _set_fusions(monkeypatch, True)
    calls = {"norm": 0, "act": 0, "rope_cache": 0, "rope_apart": 0}

    def counted(key, fn):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(folded.FoldedNorm, "linear", counted("norm", folded.FoldedNorm.linear))
    monkeypatch.setattr(folded.FoldedSiluMul, "linear", counted("act", folded.FoldedSiluMul.linear))
    monkeypatch.setattr(cuda_backend, "_rope_and_cache", counted("rope_cache", cuda_backend._rope_and_cache))
    monkeypatch.setattr(RotaryEmbedding, "forward", counted("rope_apart", RotaryEmbedding.forward))
    llm = LLM(str(path), device="cuda", dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0,
              kv_cache_memory_gb=0.25)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for key in calls:
        calls[key] = 0  # whatever start-up ran
    llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)
    layers, decode_steps = 3, 2  # one prefill step, then two decode steps
    assert calls == {"norm": 2 * layers * decode_steps, "act": layers * decode_steps,
                     "rope_cache": layers * (decode_steps + 1), "rope_apart": 0}
