#!/usr/bin/env python
"""int8_linear's activation schemes against each other and against linear_small_m (bf16 weight) on decode shapes.

    python benchmarks/bench_int8_linear.py                   # the ~1B Llama shapes, M = 1, every scheme
    python benchmarks/bench_int8_linear.py --m 1,4 --schemes absmax,group64 --repeats 15
    PAGELLM_NUM_THREADS=1 python benchmarks/bench_int8_linear.py --threads 1 --clock cpu   # robust on a busy machine
    python benchmarks/bench_int8_linear.py --breakdown --schemes group64   # where an M = 1 call's time goes

Schemes: "absmax" / "zeropoint" (one activation scale per row), "group<G>" (one per G elements of K), each with
the default outlier threshold 6 on activations below it (no outlier columns: the common decode case; "--outliers"
plants one column over it). Every op cycles over enough weight copies (>= --stream-mib each) that a call finds
none of its weight in the caches, as in a decode step. A round times --calls calls of each variant in turn
(interleaved); the table gives the per-call median over --repeats rounds, and each scheme's ratio to bf16 and
to absmax within the same rounds. Writes benchmarks/results/int8_linear_<tag>.{md,json}.

--breakdown (M = 1, the first scheme): the op against linear_small_m in GB/s of weight bytes (int8 rows + fp32
scales; bf16 rows) beside the copy bandwidth (read + write) measured before and after in the same run, and its
parts by timing variants in the same interleaved rounds: the op on a 4-row weight (the activation pass and the
call's fixed cost: the GEMV is nothing there), the GEMV as the difference, the per-row absmax scheme (no group
rescale) and one activation column over the threshold (the outlier path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import common as C
import torch

from pagellm import ops

# (name, N, K) of a ~1B Llama decoder layer (TinyLlama-1.1B: hidden 2048, q + kv 2560, MLP 5632 merged gate/up)
SHAPES_1B = [("qkv 2560x2048", 2560, 2048), ("o 2048x2048", 2048, 2048), ("gate_up 11264x2048", 11264, 2048),
             ("down 2048x5632", 2048, 5632)]


def scheme_args(name: str) -> tuple[bool, int]:
    """(zero_point, group_size) of a scheme name."""
    if name == "absmax":
        return False, 0
    if name == "zeropoint":
        return True, 0
    if name.startswith("group") and name[5:].isdigit():
        return False, int(name[5:])
    raise ValueError(f"unknown scheme {name!r}: absmax, zeropoint or group<G>")


def copies_of(make, nbytes: int, stream_bytes: int) -> list:
    return [make(seed) for seed in range(max(2, -(-stream_bytes // nbytes)))]


# "cpu": this thread's CPU time (with --threads 1: time spent descheduled by other processes is not counted,
# memory stalls are)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def per_call_s(fn, copies: list, calls: int, clock=time.perf_counter) -> float:
    t = clock()
    for c in range(calls):
        fn(copies[c % len(copies)])
    return (clock() - t) / calls


def bench_shape(n: int, k: int, m: int, schemes: list[str], args) -> dict:
    stream = args.stream_mib << 20
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(m, k, generator=g) * 1.5).clamp(-5.5, 5.5).bfloat16()
    if args.outliers:
        x[:, 7] = 9.0
    out = torch.empty(m, n, dtype=torch.bfloat16)
    bf16 = copies_of(lambda s: torch.randn(n, k, generator=torch.Generator().manual_seed(s)).bfloat16(), 2 * n * k,
                     stream)
    int8 = copies_of(lambda s: (torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(s),
                                              dtype=torch.int8), torch.rand(n) / 100), n * k, stream)
    run = {"bf16": (lambda w: ops.linear_small_m(out, x, w), bf16)}
    for name in schemes:
        zp, gs = scheme_args(name)
        run[name] = (lambda w, zp=zp, gs=gs: ops.int8_linear(out, x, w[0], w[1], None, 6.0, zp, gs), int8)
    for fn, copies in run.values():  # warm-up: page faults, the thread pool
        per_call_s(fn, copies, len(copies))
    times: dict[str, list[float]] = {name: [] for name in run}
    for _ in range(args.repeats):
        for name, (fn, copies) in run.items():
            times[name].append(per_call_s(fn, copies, args.calls, CLOCKS[args.clock]))
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    ratio_bf16 = {name: statistics.median(a / b for a, b in zip(times[name], times["bf16"])) for name in schemes}
    ratio_absmax = {name: statistics.median(a / b for a, b in zip(times[name], times[schemes[0]])) for name in schemes}
    return {"n": n, "k": k, "m": m, "ms": med, "vs_bf16": ratio_bf16, "vs_first": ratio_absmax}


def copy_gbs(clock, nbytes: int = 256 << 20, iters: int = 5) -> float:
    """A large tensor.copy_ in GB/s (read + write), median of `iters`, timed by `clock` (common.copy_bandwidth_gbs
    with the op timings' clock: thread CPU time under --clock cpu, so descheduled time counts for neither)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    ts = []
    for _ in range(iters):
        t = clock()
        dst.copy_(src)
        ts.append(clock() - t)
    return 2 * nbytes / statistics.median(ts) / 1e9


def bench_breakdown(n: int, k: int, scheme: str, args) -> dict:
    """M = 1 timing variants of one shape (see the module docstring), interleaved per round."""
    stream = args.stream_mib << 20
    zp, gs = scheme_args(scheme)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1, k, generator=g) * 1.5).clamp(-5.5, 5.5).bfloat16()
    x_outlier = x.clone()
    x_outlier[:, 7] = 9.0
    out, out4 = torch.empty(1, n, dtype=torch.bfloat16), torch.empty(1, 4, dtype=torch.bfloat16)
    bf16 = copies_of(lambda s: torch.randn(n, k, generator=torch.Generator().manual_seed(s)).bfloat16(), 2 * n * k,
                     stream)
    int8 = copies_of(lambda s: (torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(s),
                                              dtype=torch.int8), torch.rand(n) / 100), n * k, stream)
    w4 = [(w[:4].clone(), s[:4].clone()) for w, s in int8[:2]]
    op = ops.int8_linear
    run = {
        "bf16": (lambda w: ops.linear_small_m(out, x, w), bf16),
        "int8": (lambda w: op(out, x, w[0], w[1], None, 6.0, zp, gs), int8),
        "quantize": (lambda w: op(out4, x, w[0], w[1], None, 6.0, zp, gs), w4),
        "absmax": (lambda w: op(out, x, w[0], w[1], None, 6.0, False, 0), int8),
        "outlier": (lambda w: op(out, x_outlier, w[0], w[1], None, 6.0, zp, gs), int8),
    }
    for fn, copies in run.values():
        per_call_s(fn, copies, len(copies))
    times: dict[str, list[float]] = {name: [] for name in run}
    for _ in range(args.repeats):
        for name, (fn, copies) in run.items():
            times[name].append(per_call_s(fn, copies, args.calls, CLOCKS[args.clock]))
    med = {name: statistics.median(t) for name, t in times.items()}
    gemv = statistics.median(a - b for a, b in zip(times["int8"], times["quantize"]))
    int8_bytes, bf16_bytes = n * k + 4 * n, 2 * n * k
    return {"n": n, "k": k, "ms": {name: t * 1e3 for name, t in med.items()}, "gemv_ms": gemv * 1e3,
            "ratio": statistics.median(a / b for a, b in zip(times["int8"], times["bf16"])),
            "bf16_gbs": bf16_bytes / med["bf16"] / 1e9, "int8_gbs": int8_bytes / med["int8"] / 1e9,
            "gemv_gbs": int8_bytes / gemv / 1e9 if gemv > 0 else float("nan")}


def breakdown_table(rows: list[dict], scheme: str, copy: list[float], threads: int, args) -> str:
    header = ["shape (N x K)", "bf16 ms", f"{scheme} ms", "ratio", "bf16 GB/s", "int8 GB/s", "activations + call ms",
              "GEMV ms", "GEMV GB/s", "per-row absmax ms", "one outlier column ms"]
    body = [[r["shape"], r["ms"]["bf16"], r["ms"]["int8"], r["ratio"], r["bf16_gbs"], r["int8_gbs"],
             r["ms"]["quantize"], r["gemv_ms"], r["gemv_gbs"], r["ms"]["absmax"], r["ms"]["outlier"]] for r in rows]
    return (f"int8_linear {scheme} vs linear_small_m at M = 1, bf16 x, {threads} threads, {args.clock} clock, medians "
            f"of {args.repeats} interleaved rounds of {args.calls} calls (ratio: median of per-round ratios); copy "
            f"bandwidth (read + write) {copy[0]:.1f} GB/s before, {copy[1]:.1f} after; load "
            f"{C.loadavg()[0]:.2f}\n\n" + C.md_table(header, body))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1", help="comma-separated activation rows")
    ap.add_argument("--schemes", default="absmax,zeropoint,group64,group128", help="the first is the ratio base")
    ap.add_argument("--outliers", action="store_true", help="one activation column over the threshold")
    ap.add_argument("--repeats", type=int, default=9, help="rounds (medians over these)")
    ap.add_argument("--calls", type=int, default=20, help="calls of each variant per round")
    ap.add_argument("--stream-mib", type=int, default=96, help="weight copies per format, at least this many MiB")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: thread CPU time, needs --threads 1")
    ap.add_argument("--breakdown", action="store_true", help="M = 1 parts and GB/s of the first scheme")
    ap.add_argument("--tag", default="1b")
    args = ap.parse_args()
    if args.clock == "cpu" and (args.threads != 1 or os.environ.get("PAGELLM_NUM_THREADS") != "1"):
        ap.error("--clock cpu times the calling thread only: pass --threads 1 with PAGELLM_NUM_THREADS=1")
    if os.environ.get("PAGELLM_NUM_THREADS"):  # the kernels' own pool (threading_config.py)
        from pagellm.threading_config import ThreadingConfig, apply_threading
        apply_threading(ThreadingConfig.from_env())
    threads = C.setup_threads(args.threads)
    schemes = args.schemes.split(",")
    if args.breakdown:
        copy = [copy_gbs(CLOCKS[args.clock])]
        rows = []
        for name, n, k in SHAPES_1B:
            rows.append({"shape": name, **bench_breakdown(n, k, schemes[0], args)})
            print(f"{name}: " + ", ".join(f"{v} {t:.3f} ms" for v, t in rows[-1]["ms"].items()), flush=True)
        copy.append(copy_gbs(CLOCKS[args.clock]))
        md = breakdown_table(rows, schemes[0], copy, threads, args)
        print(md)
        C.save_results(f"int8_breakdown_{args.tag}", md, {"args": vars(args), "rows": rows, "copy_gbs": copy,
                                                          "env": C.env_info()})
        return
    rows = []
    for m in (int(v) for v in args.m.split(",")):
        for name, n, k in SHAPES_1B:
            r = bench_shape(n, k, m, schemes, args)
            rows.append({"shape": name, **r})
            print(f"{name} M={m}: " + ", ".join(f"{s} {r['ms'][s]:.3f} ms" for s in ["bf16"] + schemes), flush=True)
    header = ["shape (N x K)", "M", "bf16 ms"] + [f"{s} ms" for s in schemes] + [f"{s} / bf16" for s in schemes] + [
        f"{s} / {schemes[0]}" for s in schemes[1:]]
    md = C.md_table(header, [[r["shape"], r["m"], r["ms"]["bf16"]] + [r["ms"][s] for s in schemes]
                             + [r["vs_bf16"][s] for s in schemes] + [r["vs_first"][s] for s in schemes[1:]]
                             for r in rows])
    md = (f"int8_linear by activation scheme vs linear_small_m, bf16 x, {threads} threads, {args.clock} clock, "
          f"{'one outlier column' if args.outliers else 'no outlier columns'}, medians of {args.repeats} "
          f"interleaved rounds (ratios: medians of the per-round ratios)\n\n" + md)
    print(md)
    C.save_results(f"int8_linear_{args.tag}", md, {"args": vars(args), "rows": rows, "env": C.env_info()})


if __name__ == "__main__":
    main()
