#!/usr/bin/env python
"""Batch-1 decode under different settings of the CPU kernels' thread pool, interleaved in one engine (issue 22).

    python benchmarks/bench_pool_split.py --rounds 8                          # default model, bf16
    python benchmarks/bench_pool_split.py --dtype float32 --arms chunks,sections
    python benchmarks/bench_pool_split.py --model-size 1b --rounds 4
    python benchmarks/bench_pool_split.py --competitor spin                   # one busy process alongside

Arms (`_C.configure_thread_pool` between rounds; the workers restart, the weights stay where they are):
  chunks    every thread claims the region's chunks from one counter, in range order (interleaved: the
            pool before session 15)
  sections  each thread runs its own contiguous section of the range first, then helps from the others'
            ends (`home_sections`), no prefetch: the defaults
  prefetch  sections, and the idle worker prefetches the first 256 KiB (over all sections) of the next
            projection's weight between regions (`prefetch_kb`); prefetch128 / prefetch512: other amounts
Each round runs, per arm, one greedy request of --output-len new tokens after a 256-token prompt through
LLMEngine.step and times every decode step (prefill untimed); arm order rotates per round. Per arm: the
median step over all rounds, the median of the round medians, the 10th-percentile and fastest step (on a
loaded machine: the steps the OS let run undisturbed), and the ratios to the first arm. With --competitor spin a Python busy loop runs during the rounds as well (the TPOT under one
competing process must stay <= 2x the quiet one; compare with a run without it). The 1-min load average
is printed before and after.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

import bench_step_profile as B
import common as C

ARMS = {
    "chunks": {"home_sections": False, "prefetch_kb": 0},
    "sections": {"home_sections": True, "prefetch_kb": 0},
    "prefetch": {"home_sections": True, "prefetch_kb": 256},
    "prefetch128": {"home_sections": True, "prefetch_kb": 128},
    "prefetch512": {"home_sections": True, "prefetch_kb": 512},
}


def configure(arm: str) -> None:
    from pagellm import _C

    s = _C.thread_pool_info()
    settings = {k: s[k] for k in ("num_threads", "bind", "spin_us", "chunks_per_thread", "max_backoff_ms",
                                  "home_sections", "prefetch_kb")}
    settings.update(ARMS[arm])
    _C.configure_thread_pool(**settings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--model-size", default="default", choices=["default", "1b"])
    ap.add_argument("--arms", default="chunks,sections,prefetch", help=f"comma list of {sorted(ARMS)}")
    ap.add_argument("--competitor", choices=["none", "spin"], default="none")
    ap.add_argument("--max-load", type=float, default=0.0,
                    help="wait (up to --wait-s) for the 1-min load average to drop below this first; 0: don't")
    ap.add_argument("--wait-s", type=float, default=600.0)
    args = ap.parse_args()
    arms = args.arms.split(",")
    if not arms or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms: each of {sorted(ARMS)}")

    if args.max_load > 0:
        print(C.wait_for_load(args.max_load, args.wait_s, poll_s=15.0), flush=True)
    prompt = list(range(100, 356))
    llm = B.make_llm(args.model_size, args.dtype, 512)
    for arm in arms:  # warm-up: step graphs captured, every arm's workers started once
        configure(arm)
        C.decode_step_times(llm, prompt, 8)
    load0 = C.loadavg()
    comp = None
    if args.competitor == "spin":
        comp = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    steps: dict[str, list[float]] = {a: [] for a in arms}
    round_medians: dict[str, list[float]] = {a: [] for a in arms}
    try:
        for r in range(args.rounds):
            for i in range(len(arms)):
                arm = arms[(r + i) % len(arms)]
                configure(arm)
                t = C.decode_step_times(llm, prompt, args.output_len)
                steps[arm] += t
                round_medians[arm].append(statistics.median(t))
    finally:
        if comp is not None:
            comp.kill()
            comp.wait()
    load1 = C.loadavg()
    print(f"model {args.model_size} {args.dtype}, {args.rounds} rounds x {args.output_len} steps, competitor "
          f"{args.competitor}; 1-min load {load0[0]:.2f} -> {load1[0]:.2f}")
    base = statistics.median(steps[arms[0]])
    base_p10 = statistics.quantiles(steps[arms[0]], n=10)[0]
    rows = []
    for a in arms:
        med = statistics.median(steps[a])
        p10 = statistics.quantiles(steps[a], n=10)[0]
        rows.append([a, med * 1e3, statistics.median(round_medians[a]) * 1e3, p10 * 1e3, min(steps[a]) * 1e3,
                     med / base, p10 / base_p10, " ".join(f"{m * 1e3:.2f}" for m in round_medians[a])])
    print(C.md_table(["arm", "median step ms", "median of rounds ms", "p10 ms", "fastest ms", f"/ {arms[0]}",
                      "p10 ratio", "round medians ms"], rows))
    from pagellm import _C

    info = _C.thread_pool_info()
    print(f"pool stalls so far: {info['num_stalls']}, prefetched {info['prefetched_bytes'] / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
