"""Candidate trees fitted to trained heads (`pagellm train-medusa` stores them in medusa_config.json; a speculative
config takes one with `"tree": "heads"` or `"heads:N"`).

A tree's worth on a CPU is accepted tokens per verify cost: every node is one more query row of the target's step.
Which nodes pay is a property of the heads, so it is measured on the held-out answers, served the way the engine
serves (bf16 states, the proposer's LM head, Hydra heads fed their parent node's token): for every path of ranks
< `max_rank` down to the heads' depth, how often the path's tokens are exactly the answer's next tokens. The
expected number of accepted drafts of a tree is the sum of its nodes' rates (a node is accepted iff its path
matches), and a child's rate never exceeds its parent's, so the best tree of N nodes is the N best paths taken
best-first (Medusa's medusa_choices were found the same way, by simulation on held-out data). Each fitted tree is
then walked along the answers as the engine walks them (`tree_walk`, the chain_walk of a tree) for its served mean
accepted length. Which N to serve depends on the machine's verify cost per row (bench_verify_rows.py): the
trainer stores several sizes.
"""

from __future__ import annotations

from itertools import product
from typing import Callable

import torch

from pagellm.spec_decode.medusa_tree import MedusaTree

TREE_SIZES = (3, 4, 6, 8, 12, 16, 24)  # node counts the trainer fits and stores


def full_tree(max_rank: int, depth: int) -> MedusaTree:
    """Every path of ranks < max_rank and length <= depth."""
    paths = [p for d in range(1, depth + 1) for p in product(range(max_rank), repeat=d)]
    return MedusaTree.from_spec(paths)


@torch.no_grad()
def path_hits(heads, lm_head: Callable, hidden: torch.Tensor, token_ids: torch.Tensor, flat: torch.Tensor,
              tree: MedusaTree, to_token_ids: Callable | None = None, chunk: int = 512) -> torch.Tensor:
    """[M, N]: at flat position t (the target just chose token t + 1 from h_t), whether node j's path is exactly the
    text's tokens t + 2 .. t + 1 + len(path) (the drafts the engine would accept along it). Positions whose path
    would run past the text count as misses."""
    ids = token_ids.reshape(-1)
    h_all = hidden.reshape(-1, hidden.shape[-1])
    depths = torch.tensor(tree.depths)
    parents = list(tree.parents)
    out = []
    for i in range(0, len(flat), chunk):
        pos = flat[i : i + chunk]
        nodes = heads.draft_tree(h_all[pos].float(), ids[pos + 1], tree.parents, tree.ranks, lm_head, to_token_ids)
        target_pos = (pos[:, None] + 2 + depths[None, :]).clamp(max=len(ids) - 1)
        own = (nodes == ids[target_pos]) & (pos[:, None] + 2 + depths[None, :] < len(ids))
        hits = own.clone()
        for j, p in enumerate(parents):  # parents come first: a node hits if its whole path does
            if p >= 0:
                hits[:, j] &= hits[:, p]
        out.append(hits)
    return torch.cat(out) if out else torch.zeros(0, tree.num_nodes, dtype=torch.bool)


def tree_runs(tree: MedusaTree, hits: torch.Tensor) -> torch.Tensor:
    """[M, N] path hits -> [M] drafts the engine accepts (the deepest node whose path matches; 0 if none)."""
    depth1 = torch.tensor(tree.depths) + 1
    if not hits.shape[1]:
        return torch.zeros(len(hits), dtype=torch.long)
    return (hits.long() * depth1[None, :]).max(dim=1).values


def walk(flat: torch.Tensor, runs: list[int]) -> dict[str, float]:
    """The engine's walk along sorted positions `flat` (a gap: another answer), `runs[i]` accepted drafts when it
    stands at position i: it moves on 1 + runs; returns the first draft's acceptance per step and the mean accepted
    length (1 + accepted drafts per step)."""
    starts = [0] + (torch.nonzero(flat[1:] - flat[:-1] > 1).flatten() + 1).tolist() if len(flat) else []
    steps = accepted = first = 0
    for s, e in zip(starts, starts[1:] + [len(runs)]):
        i = s
        while i < e:
            steps, accepted, first = steps + 1, accepted + runs[i], first + (runs[i] > 0)
            i += 1 + runs[i]
    return {"head1": first / max(1, steps), "accepted_len": 1 + accepted / max(1, steps)}


def fit_paths(tree: MedusaTree, hits: torch.Tensor, num_nodes: int) -> list[tuple[int, ...]]:
    """The num_nodes paths of `tree` with the highest hit rates, taken best-first among nodes whose parent is
    taken (ties: the shorter, then the lower ranks), in (depth, path) order."""
    rates = hits.float().mean(0).tolist() if len(hits) else [0.0] * tree.num_nodes
    chosen: set[int] = set()
    while len(chosen) < min(num_nodes, tree.num_nodes):
        ready = [j for j in range(tree.num_nodes)
                 if j not in chosen and (tree.parents[j] < 0 or tree.parents[j] in chosen)]
        chosen.add(max(ready, key=lambda j: (rates[j], -len(tree.paths[j]), [-r for r in tree.paths[j]])))
    return sorted((tree.paths[j] for j in chosen), key=lambda p: (len(p), p))


@torch.no_grad()
def fit_trees(heads, lm_head: Callable, hidden: torch.Tensor, token_ids: torch.Tensor, flat: torch.Tensor,
              to_token_ids: Callable | None = None, sizes=TREE_SIZES, max_rank: int = 4) -> dict[str, dict]:
    """{str(N): {"paths": [...], "expected_len": 1 + sum of its nodes' rates, "accepted_len": its served walk}} for
    each size N, fitted on held-out positions `flat` (see path_hits), plus "chain" (the top-1 chain's walk)."""
    full = full_tree(max_rank, heads.num_heads)
    hits = path_hits(heads, lm_head, hidden, token_ids, flat, full, to_token_ids)
    rates = hits.float().mean(0) if len(hits) else torch.zeros(full.num_nodes)
    out: dict[str, dict] = {}
    for n in sizes:
        paths = fit_paths(full, hits, n)
        sub = MedusaTree.from_spec(paths)
        keep = [full.paths.index(p) for p in sub.paths]  # hits columns in the served tree's node order
        walked = walk(flat, tree_runs(sub, hits[:, keep]).tolist())
        out[str(n)] = {"paths": [list(p) for p in paths], "expected_len": round(1 + float(rates[keep].sum()), 4),
                       "accepted_len": round(walked["accepted_len"], 4)}
    chain_paths = [(0,) * d for d in range(1, heads.num_heads + 1)]
    runs = tree_runs(MedusaTree.from_spec(chain_paths), hits[:, [full.paths.index(p) for p in chain_paths]])
    out["chain"] = {"paths": [list(p) for p in chain_paths],
                    "accepted_len": round(walk(flat, runs.tolist())["accepted_len"], 4)}
    return out
