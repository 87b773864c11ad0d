#!/usr/bin/env python
"""awq_linear (4-bit AWQ, bf16 x) against linear_small_m (bf16 weight) on decode shapes, interleaved in one run.

    python benchmarks/bench_awq_linear.py                 # the ~1B Llama shapes (hidden 2048, GQA 256, MLP 5632), M = 1
    python benchmarks/bench_awq_linear.py --m 1,4 --group 64 --repeats 15
    python benchmarks/bench_awq_linear.py --threads 1 --clock cpu      # thread CPU time: robust on a busy machine

Each op cycles over enough copies of its weight that a call finds none of it in the caches (>= --stream-mib
per format), as a model's decode step does. A round times --calls calls of each op in turn; the table gives
the median over --repeats rounds per call: ms, the ratio AWQ / bf16, and the effective weight stream in GB/s
(bytes read: AWQ's qweight + scales + zeros, bf16's weight). Writes benchmarks/results/awq_linear_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common as C
import torch

from pagellm import ops

# (name, N, K) of a ~1B Llama decoder layer (TinyLlama-1.1B: hidden 2048, 4 KV heads of 64, MLP 5632)
SHAPES_1B = [("qo 2048x2048", 2048, 2048), ("kv 256x2048", 256, 2048), ("gate/up 5632x2048", 5632, 2048),
             ("down 2048x5632", 2048, 5632)]


# "cpu": this thread's CPU time, for --threads 1 on a shared machine (time the thread sat descheduled is not
# counted; memory stalls are).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def weight_copies(make, nbytes_one: int, stream_bytes: int) -> list:
    return [make(seed) for seed in range(max(2, -(-stream_bytes // nbytes_one)))]


def awq_weight(n: int, k: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.01 + 0.001
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8)
    return qweight, scales, zeros


def time_calls(fn, copies: list, calls: int, clock=time.perf_counter) -> float:
    """Seconds per call, over `calls` calls cycling through `copies`."""
    t = clock()
    for c in range(calls):
        fn(copies[c % len(copies)])
    return (clock() - t) / calls


def bench_shape(n: int, k: int, m: int, args) -> dict:
    stream = args.stream_mib << 20
    x = torch.randn(m, k).bfloat16()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    bf16 = weight_copies(lambda s: torch.randn(n, k, generator=torch.Generator().manual_seed(s)).bfloat16(),
                         2 * n * k, stream)
    awq_bytes = n * k // 2 + n * (k // args.group) * 5
    awq = weight_copies(lambda s: awq_weight(n, k, args.group, s), awq_bytes, stream)
    run = {"bf16": lambda w: ops.linear_small_m(out, x, w),
           "awq": lambda w: ops.awq_linear(out, x, *w, args.group)}
    copies = {"bf16": bf16, "awq": awq}
    for name in run:  # warm-up: page faults, the thread pool
        time_calls(run[name], copies[name], len(copies[name]))
    times: dict[str, list[float]] = {name: [] for name in run}
    for _ in range(args.repeats):
        for name in run:
            times[name].append(time_calls(run[name], copies[name], args.calls, CLOCKS[args.clock]))
    bf16_s, awq_s = statistics.median(times["bf16"]), statistics.median(times["awq"])
    return {"n": n, "k": k, "m": m, "bf16_ms": bf16_s * 1e3, "awq_ms": awq_s * 1e3, "ratio": awq_s / bf16_s,
            "bf16_gbs": 2 * n * k / bf16_s / 1e9, "awq_gbs": awq_bytes / awq_s / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1", help="comma-separated activation rows")
    ap.add_argument("--group", type=int, default=128, help="AWQ group size")
    ap.add_argument("--repeats", type=int, default=9, help="rounds (medians over these)")
    ap.add_argument("--calls", type=int, default=20, help="calls of each op per round")
    ap.add_argument("--stream-mib", type=int, default=96, help="weight copies per op, at least this many MiB")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: thread CPU time, needs --threads 1")
    ap.add_argument("--tag", default="1b")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu times the calling thread only: pass --threads 1")
    threads = C.setup_threads(args.threads)
    rows = []
    for m in (int(v) for v in args.m.split(",")):
        for name, n, k in SHAPES_1B:
            r = bench_shape(n, k, m, args)
            rows.append({"shape": name, **r})
            print(f"{name} M={m}: bf16 {r['bf16_ms']:.3f} ms ({r['bf16_gbs']:.1f} GB/s), awq {r['awq_ms']:.3f} ms "
                  f"({r['awq_gbs']:.1f} GB/s), ratio {r['ratio']:.2f}", flush=True)
    md = C.md_table(["shape (N x K)", "M", "bf16 ms", "AWQ ms", "AWQ / bf16", "bf16 GB/s", "AWQ GB/s"],
                    [[r["shape"], r["m"], r["bf16_ms"], r["awq_ms"], r["ratio"], r["bf16_gbs"], r["awq_gbs"]]
                     for r in rows])
    md = (f"awq_linear (group {args.group}) vs linear_small_m, bf16 x, {threads} threads, {args.clock} clock, "
          f"medians of {args.repeats}\n\n" + md)
    print(md)
    C.save_results(f"awq_linear_{args.tag}", md, {"args": vars(args), "rows": rows, "env": C.env_info()})


if __name__ == "__main__":
    main()
