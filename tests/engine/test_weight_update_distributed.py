"""LLM.update_weights_from_distributed over gloo: a trainer process broadcasts a perturbed checkpoint's tensors to
an engine process (two spawned processes on 127.0.0.1, a free port); the engine's greedy tokens and logprobs
then equal a fresh LLM built from the perturbed checkpoint. Every wait is bounded (process-group timeout,
join timeout, then terminate), so a failure never hangs CI."""

from __future__ import annotations

import json
import shutil
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

TIMEOUT_S = 120
PROMPTS = ["hello world", "def main():"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))


def _trainer(port: int, weights_file: str) -> None:
    import torch.distributed as dist

    _init(0, port)
    for tensor in load_file(weights_file).values():  # the engine got the same names, in this order
        dist.broadcast(tensor.contiguous(), src=0)
    dist.barrier()
    dist.destroy_process_group()


def _greedy(llm) -> list:
    from pagellm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True),
                        use_tqdm=False)
    return [[list(o.outputs[0].token_ids), [{str(t): lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]]
            for o in outs]


def _engine(port: int, model_dir: str, weights_file: str, result_file: str) -> None:
    import torch.distributed as dist

    from pagellm import LLM

    header = load_file(weights_file)  # names / dtypes / shapes: what a trainer sends ahead (metadata only)
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=128)
    before = _greedy(llm)
    _init(1, port)
    result = llm.update_weights_from_distributed(None, list(header), [t.dtype for t in header.values()],
                                                 [t.shape for t in header.values()], src=0)
    dist.barrier()
    dist.destroy_process_group()
    Path(result_file).write_text(json.dumps({"num_tensors": result["num_tensors"], "before": before,
                                             "after": _greedy(llm)}))


def test_gloo_broadcast_equals_fresh_llm(tiny_llama_dir, tmp_path):
    from pagellm import LLM

    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    perturbed_dir = tmp_path / "perturbed"
    shutil.copytree(tiny_llama_dir, perturbed_dir)
    weights_file = str(perturbed_dir / "model.safetensors")
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()}, weights_file,
              metadata={"format": "pt"})
    result_file = tmp_path / "result.json"
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_trainer, args=(port, weights_file)),
             ctx.Process(target=_engine, args=(port, str(tiny_llama_dir), weights_file, str(result_file)))]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(TIMEOUT_S)
    finally:
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.terminate()
            p.join(10)
    assert not hung, "a process did not finish within the timeout"
    assert [p.exitcode for p in procs] == [0, 0]
    result = json.loads(result_file.read_text())
    assert result["num_tensors"] == len(weights)
    fresh = _greedy(LLM(str(perturbed_dir), num_kv_blocks=64, max_model_len=128))
    for (tok_a, lp_a), (tok_b, lp_b) in zip(result["after"], fresh):
        assert tok_a == tok_b
        for da, db in zip(lp_a, lp_b):
            assert da.keys() == db.keys()
            assert all(da[t] == pytest.approx(db[t], abs=1e-5) for t in da)
    assert result["after"] != result["before"]
