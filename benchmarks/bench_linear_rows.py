#!/usr/bin/env python
"""bf16 linear_small_m vs torch's F.linear (oneDNN) at batch row counts on the default model's shapes (issue 22).

    python benchmarks/bench_linear_rows.py --rows 16,64,2048
    /other/checkout/.venv/bin/python benchmarks/bench_linear_rows.py   # the same against another build (A/B)

One thread (pagellm's pool and torch), thread CPU time per call (median), so a busy shared machine skews it
less than wall time; GFLOP/s = 2 M N K / time. Shapes: SmolLM2-135M's qkv (960 x 576), o (576 x 576),
gate_up (3072 x 576), down (576 x 1536) and, up to 64 rows, the LM head (49152 x 576).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576))


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
    args = ap.parse_args()
    from pagellm import _C

    torch.set_num_threads(1)
    _C.configure_thread_pool(1, bind=False)
    print("| M | shape | linear_small_m GFLOP/s | F.linear GFLOP/s | small_m time / F.linear time |")
    print("|---:|---|---:|---:|---:|")
    for m in (int(v) for v in args.rows.split(",")):
        for name, n, k in SHAPES:
            if name == "lm_head" and m > 64:
                continue
            g = torch.Generator().manual_seed(m)
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16)
            flops = 2 * m * n * k
            reps = min(30, max(3, int(2e9 / flops)))
            a = cpu_time(lambda: torch.ops.pagellm.linear_small_m(out, x, w, None), reps)
            b = cpu_time(lambda: F.linear(x, w), reps)
            print(f"| {m} | {name} | {flops / a / 1e9:.0f} | {flops / b / 1e9:.0f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
