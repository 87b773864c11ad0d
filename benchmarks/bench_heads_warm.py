#!/usr/bin/env python
"""A served Hydra tree draft after the target's weight stream, with and without warm_caches (issue 17).

    PAGELLM_NUM_THREADS=2 python benchmarks/bench_heads_warm.py --heads /work/medusa-s16 --tree heads:6

Per repeat: a 300 MB read sweep (the forward's weight stream, which evicts the L3), then `gap` ms of host work on
this thread (the verify step's bookkeeping), then the proposer's replayed tree draft, timed (wall ms). Arms,
interleaved: `cold` (nothing between the sweep and the gap), `warm` (MedusaProposer.warm_caches() right after the
sweep: the thread pool's idle workers prefetch the heads' 8.7 MB during the gap; nothing on one thread), `hot` (no
sweep: the floor).
The default model in bf16 carries the heads (their drafting graphs are the served ones).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import common as C


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="/work/medusa-s16")
    ap.add_argument("--tree", default="heads:6")
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--gap-ms", type=float, default=0.6)
    ap.add_argument("--sweep-mb", type=int, default=300)
    args = ap.parse_args()
    from pagellm import LLM, _C

    llm = LLM(model=None, dtype="bfloat16", max_model_len=512,
              speculative_config={"method": "medusa", "num_speculative_tokens": 3, "model": args.heads,
                                  "tree": args.tree, "warm_heads": True})
    prop = llm.llm_engine.proposer
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 576, generator=gen)
    last = torch.tensor([42])
    sweep = torch.ones(args.sweep_mb << 19, dtype=torch.bfloat16)
    with torch.inference_mode():
        for _ in range(4):  # capture the tree's drafting graph
            prop._draft_tree(hidden, last)
        times: dict[str, list[float]] = {"cold": [], "warm": [], "hot": []}
        for _ in range(args.repeats):
            for arm in times:
                if arm != "hot":
                    float(sweep.sum())
                if arm == "warm":
                    prop.warm_caches()
                _busy(args.gap_ms)
                t0 = time.perf_counter()
                prop._draft_tree(hidden, last)
                times[arm].append((time.perf_counter() - t0) * 1e3)
    info = _C.thread_pool_info()
    load = C.loadavg()
    print(f"threads {info['num_threads']}, warmed bytes {info['warmed_bytes']}, load {load[0]:.2f}, "
          f"gap {args.gap_ms} ms, {args.repeats} repeats")
    for arm, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        print(f"{arm:5s} median {statistics.median(ts):.3f} ms  (quartiles {q[0]:.3f} / {q[2]:.3f})")


if __name__ == "__main__":
    main()
