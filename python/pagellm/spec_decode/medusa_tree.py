"""Medusa's candidate trees: the heads' top-k tokens form a tree the target verifies in one forward
(the proposer: medusa.MedusaTreeProposer).

    LLM(model, speculative_config={"method": "medusa", "num_speculative_tokens": 3, "model": "/path/to/heads",
                                   "tree": "default"})        # or "mc_sim_7b_63", a list of paths, or "heads" /
                                                              # "heads:N": fitted to the heads (medusa_tree_fit.py)

A tree is a list of paths as in Medusa's `medusa_choices`: path (i_0, .., i_d) is the node whose token is
head d's (i_d)-th most likely token, under the node (i_0, .., i_{d-1}); every prefix of a path is a path. Nodes
are kept with the top-1 chain (0,), (0, 0), .. first, then in (depth, path) order, so parents come before children
and every prefix of the node list is a tree (the scheduler may clamp a row's drafts to a prefix). Chain first: node j
sits in the row's lookahead slot j, and an accepted path must end up in the first slots (engine/tree_step.py
move_kv_slots); the top-1 chain, the path accepted most often, then already does (session 17: in (depth, path) order
every accepted path of two or more nodes moved KV over all 60 cache tensors). With Hydra heads (hydra_heads.py) the same path names the
(i_d)-th guess of head d fed its parent node's token, so a node's siblings and children follow the branch it is on.

Greedy rows get the whole tree as drafts (in node order) and `draft_parents` says each node's parent (-1: the
row's last committed token); the engine verifies them with `paged_tree_attention` (engine/tree_step.py) and
commits the longest root-to-node path the target's argmax agrees with. Sampled rows keep the lossless chain of
top-1 drafts (rejection sampling over a tree path would be biased by the choice of path), unless the config asks
for typical acceptance (not lossless anyway): then they take trees too, and the longest path whose every node
passes the rule wins (engine/tree_step.py typical_tree_paths).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

# Small enough for a CPU's weight-bound verify step (12 nodes, depth 3: 3 heads).
DEFAULT_CPU_TREE = ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0))
# Medusa's mc_sim_7b_63 (medusa/model/medusa_choices.py): 63 nodes, depth 4 (4 heads), top-10 per head.
MC_SIM_7B_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,), (9,),
    (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1),
    (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0),
    (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
)  # fmt: skip
NAMED_TREES = {"default": DEFAULT_CPU_TREE, "mc_sim_7b_63": MC_SIM_7B_63}
MAX_TREE_NODES = 256  # the scheduler's most lookahead slots


@dataclass(frozen=True)
class MedusaTree:
    """A validated candidate tree. Node j: `paths[j]`, `parents[j]` (index of its parent node, -1 for depth-1
    nodes), `depths[j]` (0-based: the head that proposes it), `ranks[j]` (its top-k index in that head)."""

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]

    @classmethod
    def from_spec(cls, spec: Any) -> "MedusaTree":
        """A tree from a name in NAMED_TREES or a list of paths (lists of ints >= 0). ValueError for an empty
        tree, a malformed or repeated path, a path whose parent path is missing, or more than 256 nodes."""
        if isinstance(spec, str):
            if spec not in NAMED_TREES:
                raise ValueError(f"unknown Medusa tree {spec!r}; named trees: {sorted(NAMED_TREES)} "
                                 "(or give a list of paths such as [[0], [1], [0, 0]])")
            spec = NAMED_TREES[spec]
        if not isinstance(spec, (list, tuple)) or not spec:
            raise ValueError(f"a Medusa tree is a non-empty list of paths (lists of top-k indices), got {spec!r}")
        paths = [_check_path(p) for p in spec]
        if len(set(paths)) != len(paths):
            raise ValueError("Medusa tree: repeated path(s) " + str(sorted({p for p in paths if paths.count(p) > 1})))
        if len(paths) > MAX_TREE_NODES:
            raise ValueError(f"Medusa tree: {len(paths)} nodes, at most {MAX_TREE_NODES}")
        ordered = sorted(paths, key=lambda p: (len(p), p))
        known = set(ordered)
        for p in ordered:
            if len(p) > 1 and p[:-1] not in known:
                raise ValueError(f"Medusa tree: path {list(p)} has no parent path {list(p[:-1])}")
        ordered = [p for p in ordered if not any(p)] + [p for p in ordered if any(p)]  # the top-1 chain first
        index = {p: j for j, p in enumerate(ordered)}
        return cls(tuple(ordered), tuple(index[p[:-1]] if len(p) > 1 else -1 for p in ordered))

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        """Heads the tree needs (its longest path)."""
        return max(len(p) for p in self.paths)

    @property
    def depths(self) -> tuple[int, ...]:
        return tuple(len(p) - 1 for p in self.paths)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(p[-1] for p in self.paths)

    def node_tokens(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids [B, depth, max_rank + 1] (each head's most likely tokens, best first) -> [B, num_nodes]."""
        heads = torch.tensor(self.depths, device=topk_ids.device)
        ranks = torch.tensor(self.ranks, device=topk_ids.device)
        return topk_ids[:, heads, ranks]


def _check_path(path: Any) -> tuple[int, ...]:
    if (not isinstance(path, (list, tuple)) or not path
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in path)):
        raise ValueError(f"Medusa tree: each path is a non-empty list of top-k indices >= 0, got {path!r}")
    return tuple(path)


HEADS_TREE = "heads"  # "heads" / "heads:N": a tree the trainer fitted to these heads (medusa_tree_fit.py)


def _fitted_size(spec: str) -> str | None:
    """"heads" -> None (the trainer's "served" size), "heads:N" -> "N"; ValueError for another "heads..." form."""
    if spec == HEADS_TREE:
        return None
    size = spec[len(HEADS_TREE) + 1 :]
    if not spec.startswith(HEADS_TREE + ":") or not size.isdigit():
        raise ValueError(f"Medusa tree {spec!r}: use 'heads' or 'heads:N' (N: a node count the trainer fitted)")
    return str(int(size))


def tree_from_options(options: Mapping[str, Any], fitted: Mapping[str, Any] | None = None) -> MedusaTree | None:
    """The `tree` option of a medusa speculative_config (None: chain drafts). ValueError for a bad tree.
    "heads" / "heads:N" name a tree fitted to the heads at training (`fitted`: their medusa_config.json's
    training "trees"); without `fitted` only the form is checked (None), for check_options."""
    spec = options.get("tree")
    if isinstance(spec, str) and spec.startswith(HEADS_TREE):
        size = _fitted_size(spec)
        if fitted is None:
            return None
        if not fitted:
            raise ValueError(f"Medusa tree {spec!r}: these heads carry no fitted trees (medusa_config.json "
                             "training.trees; retrain with pagellm train-medusa) - give a tree instead")
        size = str(fitted.get("served")) if size is None else size
        if size not in fitted or size in ("served", "chain"):
            raise ValueError(f"Medusa tree {spec!r}: fitted sizes are "
                             f"{sorted(int(n) for n in fitted if n.isdigit())}")
        return MedusaTree.from_spec([list(p) for p in fitted[size]["paths"]])
    return None if spec is None else MedusaTree.from_spec(spec)
