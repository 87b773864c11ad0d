#!/usr/bin/env python
"""Batch-1 decode with the weights where loading left them, packed in one arena of small pages, and packed in
one huge-page arena (model_loader/weight_arena.py, PAGELLM_WEIGHT_ARENA=0 / nohuge / 1), interleaved in one
process (issue 22).

    python benchmarks/bench_weight_arena.py --rounds 6                 # default model, bf16
    python benchmarks/bench_weight_arena.py --dtype float32 --arms nohuge,huge

One engine per arm (bench_step_profile.make_llm, built with that arm's PAGELLM_WEIGHT_ARENA); each round runs,
per engine, one greedy request of 32 new tokens after a 256-token prompt through LLMEngine.step and times every
decode step (the prefill step untimed). Per arm: the median step over all rounds (robust to another process
preempting a step), the fastest step, and the process's huge-page bytes after the engines are built. Arms
alternate every ~0.3 s, so a shared machine's load hits them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics

import bench_step_profile as B
import common as C

ARMS = {"off": "0", "nohuge": "nohuge", "huge": "1"}


def anon_huge_mb() -> float:
    """AnonHugePages of this process (MB; 0 where /proc is unavailable)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--model-size", default="default", choices=["default", "1b"])
    ap.add_argument("--arms", default="off,nohuge,huge", help=f"comma list of {sorted(ARMS)}")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if not arms or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms: each of {sorted(ARMS)}")

    prompt = list(range(100, 356))

    def run(llm, n: int) -> list[float]:
        return C.decode_step_times(llm, prompt, n)

    llms, huge_mb = {}, {}
    for arm in arms:
        before = anon_huge_mb()
        os.environ["PAGELLM_WEIGHT_ARENA"] = ARMS[arm]
        llms[arm] = B.make_llm(args.model_size, args.dtype, 512)
        huge_mb[arm] = anon_huge_mb() - before
    os.environ.pop("PAGELLM_WEIGHT_ARENA")
    for llm in llms.values():
        run(llm, 40)  # captures every block-table width the timed runs meet
    steps: dict[str, list[float]] = {arm: [] for arm in arms}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for arm in arms:
            steps[arm] += run(llms[arm], 33)
        print(f"round {r} (load {loads[-1]:.1f}): "
              + ", ".join(f"{a} {statistics.median(v[-32:]) * 1e3:.2f} ms" for a, v in steps.items()), flush=True)
    print(f"\n{args.model_size} {args.dtype}, {args.rounds} rounds x 32 decode steps per arm, "
          f"load {min(loads):.1f}-{max(loads):.1f}")
    print("| arm | huge pages gained (MB) | median step ms | fastest step ms | median / first arm's |")
    print("|---|---:|---:|---:|---:|")
    ref = statistics.median(steps[arms[0]])
    for arm in arms:
        med = statistics.median(steps[arm])
        print(f"| {arm} | {huge_mb[arm]:.0f} | {med * 1e3:.3f} | {min(steps[arm]) * 1e3:.3f} | {med / ref:.3f} |")


if __name__ == "__main__":
    main()
