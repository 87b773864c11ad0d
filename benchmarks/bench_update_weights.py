"""Time of LLM.update_weights against re-creating the LLM, for the default model and a random ~1B model:
in process (tensors already in memory), from disk, and over a gloo broadcast from a trainer process.

    python benchmarks/bench_update_weights.py                     # default model + random TinyLlama-1.1B shape
    python benchmarks/bench_update_weights.py --models /path/to/hf_dir --rounds 1   # smoke run on any model

Prints a table (median seconds over --rounds) and writes benchmarks/results/update_weights.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

RESULTS = Path(__file__).parent / "results" / "update_weights.json"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _weights_file(model_dir: Path) -> list[Path]:
    from pagellm.model_loader.files import weight_files

    return weight_files(model_dir)


def _trainer(port: int, files: list[str], rounds: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                            timeout=timedelta(seconds=600))
    tensors = [t for f in files for t in load_file(f).values()]
    for _ in range(rounds):
        for t in tensors:
            dist.broadcast(t.contiguous(), src=0)
        dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_model(model_dir: Path, rounds: int) -> dict[str, float]:
    import torch.distributed as dist

    from pagellm import LLM

    kw = dict(num_kv_blocks=64, max_model_len=256)
    recreate = [_timed(lambda: LLM(str(model_dir), **kw)) for _ in range(rounds)]
    llm = LLM(str(model_dir), **kw)
    files = _weights_file(model_dir)
    tensors = [(n, t) for f in files for n, t in load_file(str(f)).items()]
    in_process = [_timed(lambda: llm.update_weights(tensors)) for _ in range(rounds)]
    from_disk = [_timed(lambda: llm.update_weights_from_disk(model_dir)) for _ in range(rounds)]
    port = _free_port()
    trainer = mp.get_context("spawn").Process(target=_trainer, args=(port, [str(f) for f in files], rounds))
    trainer.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                            timeout=timedelta(seconds=600))
    names, dtypes, shapes = [n for n, _ in tensors], [t.dtype for _, t in tensors], [t.shape for _, t in tensors]
    broadcast = []
    for _ in range(rounds):
        broadcast.append(_timed(lambda: llm.update_weights_from_distributed(None, names, dtypes, shapes)))
        dist.barrier()
    dist.destroy_process_group()
    trainer.join(60)
    num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    return {"GB": num_bytes / 1e9, "recreate_s": statistics.median(recreate),
            "update_in_process_s": statistics.median(in_process), "update_from_disk_s": statistics.median(from_disk),
            "update_gloo_broadcast_s": statistics.median(broadcast)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=None, help="HF dirs (default: the default model and a random 1B)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.models:
        models = {Path(m).name: Path(m) for m in args.models}
    else:
        from bench_quant_ppl import random_1b_model

        from pagellm.model_loader import open_model

        models = {"default (SmolLM2-135M)": Path(open_model(None).path), "random 1.1B": random_1b_model()}
    results = {name: bench_model(path, args.rounds) for name, path in models.items()}
    cols = ["GB", "recreate_s", "update_in_process_s", "update_from_disk_s", "update_gloo_broadcast_s"]
    print(f"{'model':<26}" + "".join(f"{c:>26}" for c in cols))
    for name, r in results.items():
        print(f"{name:<26}" + "".join(f"{r[c]:>26.3f}" for c in cols))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
