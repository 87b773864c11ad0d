#!/usr/bin/env python
"""linear_small_m vs torch's F.linear (oneDNN / MKL) at batch row counts on a model's shapes (issue 22).

    python benchmarks/bench_linear_rows.py --rows 16,64,2048
    python benchmarks/bench_linear_rows.py --dtype float32 --rows 1,8,64,512,2048
    python benchmarks/bench_linear_rows.py --shapes 1b --rows 1,64          # TinyLlama-1.1B's shapes
    /other/checkout/.venv/bin/python benchmarks/bench_linear_rows.py   # the same against another build (A/B)

One thread (pagellm's pool and torch), thread CPU time per call (median), so a busy shared machine skews it
less than wall time; GFLOP/s = 2 M N K / time. Shapes (default): SmolLM2-135M's qkv (960 x 576), o (576 x 576),
gate_up (3072 x 576), down (576 x 1536) and, up to 64 rows, the LM head (49152 x 576); `1b`: TinyLlama-1.1B's
(2560 x 2048, 2048 x 2048, 11264 x 2048, 2048 x 5632, LM head 32000 x 2048).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {
    "default": (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
                ("lm_head", 49152, 576)),
    "1b": (("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632),
           ("lm_head", 32000, 2048)),
}


def cpu_time(fn, n: int) -> float:
    fn()
    ts = []
    for _ in range(n):
        t = time.thread_time()
        fn()
        ts.append(time.thread_time() - t)
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,64,2048")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="default")
    args = ap.parse_args()
    from pagellm import _C

    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    _C.configure_thread_pool(1, bind=False)
    print(f"{args.dtype}, {args.shapes} shapes, one thread")
    print("| M | shape | linear_small_m GFLOP/s | F.linear GFLOP/s | small_m time / F.linear time |")
    print("|---:|---|---:|---:|---:|")
    for m in (int(v) for v in args.rows.split(",")):
        for name, n, k in SHAPES[args.shapes]:
            if name == "lm_head" and m > 64:
                continue
            g = torch.Generator().manual_seed(m)
            x = torch.randn(m, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
            out = torch.empty(m, n, dtype=dtype)
            flops = 2 * m * n * k
            reps = min(30, max(3, int(2e9 / flops)))
            a = cpu_time(lambda: torch.ops.pagellm.linear_small_m(out, x, w, None), reps)
            b = cpu_time(lambda: F.linear(x, w), reps)
            print(f"| {m} | {name} | {flops / a / 1e9:.0f} | {flops / b / 1e9:.0f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
