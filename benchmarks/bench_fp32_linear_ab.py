#!/usr/bin/env python
"""fp32 batch-1 decode with fp32 linears on torch's F.linear (the pre-session-13 routing) vs pagellm's
linear_small_m (ops/linear_dispatch.py), interleaved in one process (issue 22).

    python benchmarks/bench_fp32_linear_ab.py --rounds 5

Two engines of the default model in fp32 (bench_step_profile.make_llm); the "F.linear" one has the unquantized
LinearMethod's linear swapped for one that sends fp32 to F.linear whenever it runs (eager steps and step-graph
captures; every graph the timed runs replay is captured in its warm-up). Each round times, per engine, a
33-token and a 1-token greedy request on the same 256-token prompt: (t33 - t1) / 32 = ms per decode step, the
prefill cancelling out. Alternating the arms every few seconds makes a shared machine's load hit both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import bench_step_profile as B
import torch
import torch.nn.functional as F

WEIGHT_MB = 551.3  # bench_step_profile's bytes per token of the default model in fp32 (weights + KV at ~290)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import pagellm.quantization.unquantized as unquantized
    from pagellm import SamplingParams
    from pagellm.ops import linear_dispatch

    def fp32_on_torch(x, w, b=None):
        return F.linear(x, w, b) if x.dtype is torch.float32 else linear_dispatch.linear(x, w, b)

    arms = {"F.linear": fp32_on_torch, "linear_small_m": linear_dispatch.linear}
    prompt = list(range(100, 356))

    def run(name: str, llm, n: int) -> float:
        unquantized.linear = arms[name]  # this arm's linear for any eager step or graph capture
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        return time.perf_counter() - t

    llms = {name: B.make_llm("default", "float32", 512) for name in arms}
    for name, llm in llms.items():
        run(name, llm, 40)  # captures every block-table width the timed runs meet
    ms: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, llm in llms.items():
            ms[name].append((run(name, llm, 33) - run(name, llm, 1)) / 32 * 1e3)
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in ms.items()), flush=True)
    unquantized.linear = linear_dispatch.linear
    before, after = (statistics.median(ms[n]) for n in arms)
    print(f"fp32 decode ms/step, median of {args.rounds}: F.linear {before:.2f}, linear_small_m {after:.2f} "
          f"({before / after:.2f}x; ~{WEIGHT_MB / after:.1f} GB/s of weights + KV)")


if __name__ == "__main__":
    main()
