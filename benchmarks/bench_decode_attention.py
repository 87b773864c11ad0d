#!/usr/bin/env python
"""CPU paged decode attention at the offline-throughput shape (issue 22): S sequences x contexts in
[ctx_min, ctx_max], the default model's heads (9 q / 3 kv, head_dim 64), bf16 cache in blocks of 16 scattered at
random, one call per layer over `--layers` distinct caches (so every call streams its KV from memory, as a decode
step does). Prints wall time per step, the bytes of KV read, the bandwidth that implies, and the process CPU time
per step (all threads: on a loaded machine the wall time mostly measures the other processes).

    python benchmarks/bench_decode_attention.py                      # 64 x 128-192, 30 layers
    python benchmarks/bench_decode_attention.py --layers 1           # one layer's cache: mostly cache-resident
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import common as C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--ctx-min", type=int, default=128)
    ap.add_argument("--ctx-max", type=int, default=192)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=25)
    args = ap.parse_args()
    import pagellm.ops  # noqa: F401  (registers torch.ops.pagellm)

    g = torch.Generator().manual_seed(0)
    S, D, BS = args.seqs, args.head_dim, 16
    lens = torch.randint(args.ctx_min, args.ctx_max + 1, (S,), generator=g, dtype=torch.int32)
    blocks_per_seq = (int(lens.max()) + BS - 1) // BS
    tables = torch.randperm(S * blocks_per_seq, generator=g).to(torch.int32).view(S, blocks_per_seq)
    shape = (S * blocks_per_seq, args.kv_heads, BS, D)
    caches = [tuple(torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2)) for _ in range(args.layers)]
    q = torch.randn(S, args.heads, D, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)
    op = torch.ops.pagellm.paged_attention_decode

    def step():
        for kc, vc in caches:
            op(out, q, kc, vc, tables, lens, D**-0.5)

    step()
    la0 = C.loadavg()
    walls, cpus = [], []
    for _ in range(args.steps):
        c, t = time.process_time(), time.perf_counter()
        step()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    nbytes = int(lens.sum()) * args.kv_heads * D * 2 * 2 * args.layers
    wall = statistics.median(walls)
    print(f"{S} seqs x ctx {args.ctx_min}-{args.ctx_max}, {args.heads} q / {args.kv_heads} kv heads, D {D}, bf16, "
          f"{args.layers} layers, {torch.get_num_threads()} threads; load {la0} -> {C.loadavg()}")
    print(f"wall per step: median {wall * 1e3:.2f} ms (min {min(walls) * 1e3:.2f}); KV read {nbytes / 1e6:.0f} MB "
          f"-> {nbytes / wall / 1e9:.1f} GB/s (at the min: {nbytes / min(walls) / 1e9:.1f}); "
          f"CPU time per step (all threads): median {statistics.median(cpus) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
