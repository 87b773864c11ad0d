#!/usr/bin/env python
"""linear_small_m vs torch's F.linear (oneDNN / MKL) at batch row counts on a model's shapes (issue 22).

    python benchmarks/bench_linear_rows.py --rows 16,64,2048
    python benchmarks/bench_linear_rows.py --dtype float32 --rows 1,8,64,512,2048
    python benchmarks/bench_linear_rows.py --shapes 1b --rows 1,64          # TinyLlama-1.1B's shapes
    /other/checkout/.venv/bin/python benchmarks/bench_linear_rows.py   # the same against another build (A/B)
    python benchmarks/bench_linear_rows.py --rows 1,2,3,4,8,16 --threads 2 --no-torch   # small M, both cores
    python benchmarks/bench_linear_rows.py --vs-one-row --rows 2,4,8,13,16 --rotate-mb 128  # M rows / 1 row, paired
    python benchmarks/bench_linear_rows.py --vs-one-row --argmax --rows 4,7,16 --rotate-mb 128  # the greedy LM head

One thread (pagellm's pool and torch), thread CPU time per call (median), so a busy shared machine skews it
less than wall time; with --threads N > 1, wall time per call (median; read it with the load average).
GFLOP/s = 2 M N K / time; weight GB/s = the weight's bytes / time (the stream a small-M call is bound by);
"vs M=1" = this call's time over the same shape's at the first row count. `--vs-one-row`: per shape, calls of 1 row
and of M rows alternate (rounds x row counts), each pair's time ratio, median per M: what M rows cost over one row
measured side by side, which a shared machine's drifting load skews least (default shapes only).
Shapes (default): SmolLM2-135M's qkv (960 x 576), o (576 x 576), gate_up (3072 x 576), down (576 x 1536) and, up to
`--lm-head-max-rows` (64) rows, the LM head (49152 x 576); `1b`: TinyLlama-1.1B's
(2560 x 2048, 2048 x 2048, 11264 x 2048, 2048 x 5632, LM head 32000 x 2048).
bf16 MFU = GFLOP/s / this core's bf16 ceiling, measured in the same run by torch.ops.pagellm.bf16_dot_peak (a
register-only vdpbf16ps loop of the loaded kernel library; before and after the table, the first one is used;
"-" from a build without that op, and for fp32, which that ceiling does not bound).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

SHAPES = {
    "default": (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
                ("lm_head", 49152, 576)),
    "1b": (("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632),
           ("lm_head", 32000, 2048)),
}
PEAK_ITERS = 1 << 18  # 12 x 2^18 vdpbf16ps of 64 FLOP: ~0.2 GFLOP, ~0.4 ms at 500 GFLOP/s


def median_time(fn, n: int, warm: bool = True, clock=time.thread_time) -> float:
    """Median seconds of `n` calls of fn on `clock` (this thread's CPU time by default), after one warm-up call."""
    if warm:
        fn()
    ts = []
    for _ in range(n):
        t = clock()
        fn()
        ts.append(clock() - t)
    return sorted(ts)[len(ts) // 2]


def cpu_time(fn, n: int, warm: bool = True) -> float:
    return median_time(fn, n, warm, time.thread_time)


def wall_time(fn, n: int, warm: bool = True) -> float:
    return median_time(fn, n, warm, time.perf_counter)


def peak_gflops() -> float | None:
    """bf16_dot_peak's FLOP/s on this thread (12 independent chains of 64-FLOP pair dot products), None if absent."""
    if not hasattr(torch.ops.pagellm, "bf16_dot_peak"):
        return None
    out = torch.empty(16)
    t = cpu_time(lambda: torch.ops.pagellm.bf16_dot_peak(out, PEAK_ITERS), 21)
    return 12 * PEAK_ITERS * 64 / t / 1e9


def vs_one_row(rows: list[int], rotate_mb: int, timer, argmax: bool = False) -> None:
    """Median over alternating pairs of (M rows' time / 1 row's time) per shape, weights cycled as --rotate-mb.
    argmax: the LM head only, through linear_argmax (the greedy head: [M] token ids, no logits stored where fused)."""
    import statistics

    print("| shape | 1 row us | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|---:|" + "---:|" * len(rows))
    for name, n, k in SHAPES["default"]:
        if argmax and name != "lm_head":
            continue
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        ws = [w] + [w.clone() for _ in range((rotate_mb << 20) // (w.numel() * 2))]
        xs = {m: torch.randn(m, k, generator=g).bfloat16() for m in [1, *rows]}
        outs = {m: torch.empty(m, n, dtype=torch.bfloat16) for m in xs}
        op = torch.ops.pagellm.linear_small_m
        if argmax:
            outs = {m: torch.empty(m, dtype=torch.int64) for m in xs}
            op = torch.ops.pagellm.linear_argmax
        it, ones, ratios = 0, [], {m: [] for m in rows}
        for r in range(16 if name == "lm_head" else 61):
            for m in rows:
                t = []
                for mm in (1, m):
                    wv = ws[it % len(ws)]
                    it += 1
                    t.append(timer(lambda: op(outs[mm], xs[mm], wv, None), 1, warm=False))
                if r:  # round 0 warms up
                    ones.append(t[0])
                    ratios[m].append(t[1] / t[0])
        print(f"| {name} | {statistics.median(ones) * 1e6:.1f} | "
              + " | ".join(f"{statistics.median(ratios[m]):.2f}x" for m in rows) + " |", flush=True)


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,64,2048")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="default")
    ap.add_argument("--threads", type=int, default=1, help="pagellm pool and torch threads (> 1: wall time)")
    ap.add_argument("--no-torch", action="store_true", help="skip F.linear (its column shows -)")
    ap.add_argument("--lm-head-max-rows", type=int, default=64)
    ap.add_argument("--rotate-mb", type=int, default=0,
                    help="cycle through copies of each weight totalling this many MiB, so every call streams it "
                         "from DRAM as a decode step does (0: one copy, cache-warm)")
    ap.add_argument("--pagellm-src", default=None, help="import pagellm from this python/ dir (another build)")
    ap.add_argument("--vs-one-row", action="store_true", help="bf16: M rows' time over 1 row's, alternating pairs")
    ap.add_argument("--argmax", action="store_true",
                    help="with --vs-one-row: the LM head through linear_argmax (the greedy head) instead")
    args = ap.parse_args()
    if args.pagellm_src:
        from bench_step_profile import use_pagellm_from

        use_pagellm_from(args.pagellm_src)
    from pagellm import _C

    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    _C.configure_thread_pool(args.threads, bind=False)
    peak = peak_gflops()
    timer = cpu_time if args.threads == 1 else wall_time
    clock = "thread CPU time" if args.threads == 1 else "wall time"
    print(f"{args.dtype}, {args.shapes} shapes, {args.threads} thread(s), {clock}, load average {os.getloadavg()}")
    print(f"bf16 peak (bf16_dot_peak, {_C.cpu_kernels_isa()} kernels): {_fmt(peak, '.0f')} GFLOP/s per core\n")
    if args.vs_one_row:
        vs_one_row([int(v) for v in args.rows.split(",")], args.rotate_mb, timer, args.argmax)
        return
    if args.dtype != "bfloat16":
        peak = None  # the bf16 ceiling does not bound fp32 FMAs
    print("| M | shape | small_m us | vs M=1 | weight GB/s | linear_small_m GFLOP/s | F.linear GFLOP/s | small_m MFU | "
          "F.linear MFU | small_m time / F.linear time |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    first: dict[str, float] = {}
    for m in (int(v) for v in args.rows.split(",")):
        for name, n, k in SHAPES[args.shapes]:
            if name == "lm_head" and m > args.lm_head_max_rows:
                continue
            g = torch.Generator().manual_seed(m)
            x = torch.randn(m, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
            copies = [w] + [w.clone() for _ in range((args.rotate_mb << 20) // (w.numel() * w.element_size()))]
            nxt = iter(copies * 1000000)
            out = torch.empty(m, n, dtype=dtype)
            flops = 2 * m * n * k
            reps = min(100, max(3, int(2e9 / flops)))
            t = timer(lambda: torch.ops.pagellm.linear_small_m(out, x, next(nxt), None), reps)
            first.setdefault(name, t)
            a = flops / t / 1e9
            b = None if args.no_torch else flops / timer(lambda: F.linear(x, next(nxt)), reps) / 1e9
            mfu_a, mfu_b = (_fmt(v / peak if peak and v else None, ".2f") for v in (a, b))
            gbs = w.numel() * w.element_size() / t / 1e9
            print(f"| {m} | {name} | {t * 1e6:.1f} | {t / first[name]:.2f} | {gbs:.1f} | {a:.0f} | {_fmt(b, '.0f')} | "
                  f"{mfu_a} | {mfu_b} | {_fmt(b and b / a, '.2f')} |", flush=True)
    print(f"\nbf16 peak after the table: {_fmt(peak_gflops(), '.0f')} GFLOP/s per core")


if __name__ == "__main__":
    main()
