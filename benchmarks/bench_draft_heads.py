"""Drafting cost of Medusa and Hydra heads (spec_decode/medusa_heads.py, hydra_heads.py) alone, on the default
model's sizes (H 576, V 49152, a draft vocabulary of 8192, 3 heads): a chain of 3 and the 12-node default tree, at
batch 1 and 4, median milliseconds of interleaved repeats. Random weights (cost does not depend on training).

    python benchmarks/bench_draft_heads.py [--threads 1] [--repeats 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pagellm.spec_decode.hydra_heads import HydraHeads
from pagellm.spec_decode.medusa_heads import MedusaHeads, draft_vocab_lm_head
from pagellm.spec_decode.medusa_tree import MedusaTree

H, V, S, K = 576, 49152, 8192, 3


def _heads(kind: str, vocab: torch.Tensor) -> MedusaHeads:
    heads = (HydraHeads if kind == "hydra" else MedusaHeads)(H, V, num_heads=K)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.02)
    if kind == "hydra":
        heads.set_embedding(torch.randn(V, H))
    heads.set_draft_vocab(vocab)
    return heads.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    vocab = torch.randperm(V, generator=gen)[:S].sort().values
    lm_head = draft_vocab_lm_head(torch.randn(V, H, generator=gen), vocab)
    to_ids = lambda i: vocab[i]  # noqa: E731
    tree = MedusaTree.from_spec("default")
    cases = {}
    for kind in ("medusa", "hydra"):
        heads = _heads(kind, vocab)
        for batch in (1, 4):
            h, last = torch.randn(batch, H, generator=gen), torch.randint(0, V, (batch,), generator=gen)
            cases[(kind, batch, "chain 3")] = lambda hd=heads, h=h, t=last: hd.draft_chain(h, t, lm_head, K, to_ids)
            cases[(kind, batch, "tree 12")] = lambda hd=heads, h=h, t=last: hd.draft_tree(
                h, t, tree.parents, tree.ranks, lm_head, to_ids)
    times: dict = {key: [] for key in cases}
    with torch.inference_mode():
        for f in cases.values():  # warm-up
            f()
        for _ in range(args.repeats):  # interleaved: load changes hit every case alike
            for key, f in cases.items():
                t0 = time.perf_counter()
                f()
                times[key].append(time.perf_counter() - t0)
    print(f"torch threads {args.threads}, load average {os.getloadavg()[0]:.2f}")
    print("| heads | batch | drafts | median ms |\n|---|---:|---|---:|")
    for (kind, batch, what), ts in times.items():
        print(f"| {kind} | {batch} | {what} | {statistics.median(ts) * 1e3:.3f} |")


if __name__ == "__main__":
    main()
