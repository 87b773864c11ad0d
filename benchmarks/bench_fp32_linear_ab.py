#!/usr/bin/env python
"""fp32 batch-1 decode with fp32 linears on torch's F.linear (the pre-session-13 routing) vs pagellm's
linear_small_m (ops/linear_dispatch.py), interleaved in one process (issue 22).

    python benchmarks/bench_fp32_linear_ab.py --rounds 5

Two engines of the default model in fp32 (bench_step_profile.make_llm); the "F.linear" one has the unquantized
LinearMethod's linear swapped for one that sends fp32 to F.linear whenever it runs (eager steps and step-graph
captures; every graph the timed runs replay is captured in its warm-up). Each round runs, per engine, one
greedy request of 32 new tokens after a 256-token prompt through LLMEngine.step and times every decode step (the
prefill step untimed): per arm, the median step over all rounds (robust to another process preempting a step)
and the mean. Alternating the arms every second or so makes a shared machine's load hit both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import bench_step_profile as B
import common as C
import torch
import torch.nn.functional as F

WEIGHT_MB = 551.3  # bench_step_profile's bytes per token of the default model in fp32 (weights + KV at ~290)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import pagellm.quantization.unquantized as unquantized
    from pagellm.ops import linear_dispatch

    def fp32_on_torch(x, w, b=None):
        return F.linear(x, w, b) if x.dtype is torch.float32 else linear_dispatch.linear(x, w, b)

    arms = {"F.linear": fp32_on_torch, "linear_small_m": linear_dispatch.linear}
    prompt = list(range(100, 356))

    def run(name: str, llm, n: int) -> list[float]:
        """Decode step times (s) of one request of n new tokens."""
        unquantized.linear = arms[name]  # this arm's linear for any eager step or graph capture
        return C.decode_step_times(llm, prompt, n, f"{name}-{time.perf_counter_ns()}")

    llms = {name: B.make_llm("default", "float32", 512) for name in arms}
    for name, llm in llms.items():
        run(name, llm, 40)  # captures every block-table width the timed runs meet
    steps: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, llm in llms.items():
            steps[name] += run(name, llm, 33)
        print(f"round {r}: " + ", ".join(f"{n} {statistics.median(v[-32:]) * 1e3:.2f} ms" for n, v in steps.items()),
              flush=True)
    unquantized.linear = linear_dispatch.linear
    (b_med, a_med), (b_mean, a_mean) = ([f(steps[n]) * 1e3 for n in arms] for f in (statistics.median, statistics.mean))
    print(f"fp32 decode step, median (mean) over {args.rounds} rounds: F.linear {b_med:.2f} ({b_mean:.2f}) ms, "
          f"linear_small_m {a_med:.2f} ({a_mean:.2f}) ms: {b_med / a_med:.2f}x; {WEIGHT_MB:.0f} MB / median step = "
          f"{WEIGHT_MB / a_med:.1f} GB/s")


if __name__ == "__main__":
    main()
