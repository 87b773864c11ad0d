#!/usr/bin/env python
"""paged_attention_prefill's CPU kernels side by side (issue 22's prefill phase): the bf16 pair-dot kernel
(prefill_bf16_kernels.h) against the fp32 broadcast-FMA kernel (PAGELLM_PREFILL_BF16=0), one process, calls
interleaved, process CPU time, medians; plus each kernel's largest error against the pure-torch reference.

    PAGELLM_NUM_THREADS=1 python benchmarks/bench_prefill_attention.py             # SmolLM2's prefill call
    python benchmarks/bench_prefill_attention.py --shapes smollm2,gqa4-d128 --reps 21

Shapes: smollm2 (9 heads / 3 kv heads, head_dim 64: 16 prompts x 128 tokens, one 2048-token prefill step),
gqa4-d128 (32 / 8, head_dim 128: 4 x 512), gqa5-d80 (10 / 2, head_dim 80: 8 x 200 after a 56-token cached prefix).
On a CPU with AMX the AMX path runs instead of either (PAGELLM_PREFILL_AMX=0 to compare these two there).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

os.environ.setdefault("PAGELLM_NUM_THREADS", "1")

import torch  # noqa: E402

from pagellm import ops  # noqa: E402
from pagellm.ops import reference as ref  # noqa: E402
from pagellm.threading_config import ThreadingConfig, apply_threading  # noqa: E402

# No engine (whose Worker sizes the kernels' pool) runs here: without this the pool kept every allowed CPU
# whatever PAGELLM_NUM_THREADS said.
apply_threading(ThreadingConfig.from_env())

SHAPES = {  # heads, kv heads, head_dim, prompts, query tokens, cached prefix
    "smollm2": (9, 3, 64, 16, 128, 0),
    "gqa4-d128": (32, 8, 128, 4, 512, 0),
    "gqa5-d80": (10, 2, 80, 8, 200, 56),
}
BLOCK = 16


def make_case(heads, kv_heads, head_dim, prompts, q_len, prefix, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = q_len + prefix
    per = (seq + BLOCK - 1) // BLOCK
    num_blocks = prompts * per + 1
    kc = torch.randn(num_blocks, kv_heads, BLOCK, head_dim, generator=g).to(torch.bfloat16)
    vc = torch.randn(num_blocks, kv_heads, BLOCK, head_dim, generator=g).to(torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=g)[: prompts * per].view(prompts, per).to(torch.int32)
    query = torch.randn(prompts * q_len, heads, head_dim, generator=g).to(torch.bfloat16)
    qsl = torch.arange(0, prompts * q_len + 1, q_len, dtype=torch.int32)
    lens = torch.full((prompts,), seq, dtype=torch.int32)
    flops = 4 * heads * head_dim * prompts * sum(prefix + t + 1 for t in range(q_len))
    return (query, kc, vc, tables, qsl, lens, 1.0 / math.sqrt(head_dim)), flops


def run(args, bf16: bool) -> torch.Tensor:
    os.environ["PAGELLM_PREFILL_BF16"] = "1" if bf16 else "0"
    out = torch.empty_like(args[0])
    ops.paged_attention_prefill(out, *args)
    return out


def cpu_time(args, bf16: bool) -> float:
    t = time.process_time()
    run(args, bf16)
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2,gqa4-d128,gqa5-d80")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    threads = os.environ["PAGELLM_NUM_THREADS"]
    print(f"load {os.getloadavg()[0]:.1f}, PAGELLM_NUM_THREADS={threads}, process CPU time (all threads)")
    print("| shape | fp32 FMA ms | bf16 pair-dot ms | FMA / bf16 | bf16 GFLOP/s | max err FMA | max err bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in a.shapes.split(","):
        args, flops = make_case(*SHAPES[name])
        expected = torch.empty_like(args[0])
        ref.paged_attention_prefill(expected, *args)
        err = {k: (run(args, k).float() - expected.float()).abs().max().item() for k in (False, True)}
        times = {False: [], True: []}
        for _ in range(a.reps):
            for k in (False, True):
                times[k].append(cpu_time(args, k))
        fma, bf = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {name} | {fma * 1e3:.2f} | {bf * 1e3:.2f} | {fma / bf:.2f}x | {flops / bf / 1e9:.0f} "
              f"| {err[False]:.2e} | {err[True]:.2e} |")
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
