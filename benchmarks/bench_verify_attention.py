#!/usr/bin/env python
"""The CPU paged decode attention of one verify row: 1 + k queries at consecutive positions of one sequence, as the
cpu backend's multi-query decode passes them (one query per token, the row's block table repeated, context up to
each token), at the default model's attention shape (9 query / 3 kv heads, head_dim 64, bf16), over 30 layers'
worth of distinct caches. Per context and query count: ms per 30 layers (CPU time of this process by default: a
shared machine; `--clock wall`), median over rounds, and per query. PAGELLM_NUM_THREADS sizes the kernels' pool (before
session 16 this script left the pool at every CPU, so its "one thread" figures were two threads' CPU time). Run it from
two venvs, alternated, for an A/B of two builds.

    PAGELLM_NUM_THREADS=1 python benchmarks/bench_verify_attention.py --context 400 --queries 1,2,4,8,13
    PAGELLM_NUM_THREADS=1 python benchmarks/bench_verify_attention.py --context 51,280,777,1999 --queries 1,4
    PAGELLM_NUM_THREADS=1 python benchmarks/bench_verify_attention.py --context 150 --queries 1,7 --tree=-1,-1,0,2,-1,0

`--tree PARENTS` adds a row `tree N` per context: paged_tree_attention over a root (the row's first token, at the
context) plus one node per parent (-1: a child of the root; draft indices as a Medusa tree proposer gives them), as
a tree verify step calls it (one sequence, query_start_loc [0, 1 + k], seq_len context + 1 + k).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=lambda s: [int(x) for x in s.split(",")], default=[400],
                    help="context(s) of the row's first query")
    ap.add_argument("--queries", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 13])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10, help="30-layer passes per round and query count")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--tree", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="draft parents of a tree row to time through paged_tree_attention (-1: the root)")
    args = ap.parse_args()
    import pagellm.ops  # noqa: F401  (loads the kernels)
    from pagellm.threading_config import ThreadingConfig, apply_threading

    pool = apply_threading(ThreadingConfig.from_env())

    op = torch.ops.pagellm.paged_attention_decode.default
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"threads {pool.get('num_threads')}, load {os.getloadavg()[0]:.1f}")
    print(f"| context | queries | ms per 30 layers ({args.clock}) | per query |\n|---:|---:|---:|---:|")
    for context in args.context:
        for q, ms in _times(op, clock, context, args).items():
            n = int(q.split()[-1]) if isinstance(q, str) else q  # "tree N": the --tree row of N queries
            print(f"| {context} | {q} | {ms:.3f} | {ms / n:.3f} |")
    print(f"load {os.getloadavg()[0]:.1f}")


def _tree_call(args, context: int, table: torch.Tensor, g: torch.Generator):
    """paged_tree_attention's arguments for the --tree row (None without one)."""
    from pagellm.ops.tree import tree_mask_from_parents

    if args.tree is None:
        return None
    n = 1 + len(args.tree)
    query = torch.randn(n, 9, 64, generator=g).bfloat16()
    mask = tree_mask_from_parents([-1] + [p + 1 for p in args.tree])
    qsl = torch.tensor([0, n], dtype=torch.int32)
    lens = torch.tensor([context + n], dtype=torch.int32)
    return n, query, torch.empty_like(query), table, qsl, lens, mask


def _times(op, clock, context: int, args) -> dict[int | str, float]:
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    blocks = (context + max(args.queries + [1 + len(args.tree or [])]) + block - 1) // block + 1
    g = torch.Generator().manual_seed(0)
    caches = [tuple(torch.randn(blocks, kv_heads, block, head_dim, generator=g).bfloat16() for _ in range(2))
              for _ in range(30)]
    table = torch.randperm(blocks, generator=g).to(torch.int32)[None]
    times: dict[int | str, list[float]] = {q: [] for q in args.queries}
    tree = _tree_call(args, context, table, g)
    tree_op = torch.ops.pagellm.paged_tree_attention.default
    for _ in range(args.rounds):
        if tree is not None:
            n, query, out, tables, qsl, lens, mask = tree
            t = clock()
            for _ in range(args.iters):
                for kc, vc in caches:
                    tree_op(out, query, kc, vc, tables, qsl, lens, mask, 0.125, 0.0)
            times.setdefault(f"tree {n}", []).append((clock() - t) / args.iters * 1e3)
        for q in args.queries:
            query = torch.randn(q, heads, head_dim, generator=g).bfloat16()
            out = torch.empty_like(query)
            tables = table.expand(q, -1).contiguous()
            lens = torch.arange(context, context + q, dtype=torch.int32)
            t = clock()
            for _ in range(args.iters):
                for kc, vc in caches:
                    op(out, query, kc, vc, tables, lens, 0.125, -1, 0.0)
            times[q].append((clock() - t) / args.iters * 1e3)
    return {q: statistics.median(ts) for q, ts in times.items()}


if __name__ == "__main__":
    main()
