"""Tensor-parallel MoE experts, sharded as vLLM does: every rank holds every expert, each expert's slice of
the intermediate dimension (its gate/up rows column-parallel, its down columns row-parallel). A rank's
experts then produce a partial [T, H] sum; one all-reduce after the weighted combine (and after a shared
expert's partial output, sharded the same way) gives the layer's output. The router stays replicated, so
every rank routes every token identically and no token moves between ranks.

    w13 [E, 2I, H]  rank r holds rows [r*I/tp, (r+1)*I/tp) of the gate half and the same rows of the up half
    w2  [E, H, I]   rank r holds columns [r*I/tp, (r+1)*I/tp)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.distributed.parallel_state import get_tp_state
from pagellm.distributed.sharding import divide


@dataclass(frozen=True)
class ExpertShard:
    """Intermediate columns [start, start + local) of every expert, out of `full`."""

    full: int
    start: int
    local: int

    def slice_per_expert(self, loaded: torch.Tensor, shard: str) -> torch.Tensor:
        """One HF per-expert weight (gate / up [I, H], down [H, I]) -> this rank's rows / columns. A tensor
        of another shape passes through (the shape-checked copy then names the mismatch)."""
        dim = 1 if shard == "down" else 0
        if loaded.dim() != 2 or loaded.shape[dim] != self.full:
            return loaded
        return loaded.narrow(dim, self.start, self.local)

    def slice_stacked(self, loaded: torch.Tensor, is_w13: bool) -> torch.Tensor:
        """A stacked tensor (w13 [E, 2I, H] or w2 [E, H, I], as transformers 5.x holds them) -> this rank's part."""
        if is_w13:
            if loaded.dim() != 3 or loaded.shape[1] != 2 * self.full:
                return loaded
            gate, up = loaded.split(self.full, dim=1)
            return torch.cat([gate.narrow(1, self.start, self.local), up.narrow(1, self.start, self.local)], dim=1)
        if loaded.dim() != 3 or loaded.shape[2] != self.full:
            return loaded
        return loaded.narrow(2, self.start, self.local)


def plan_experts(intermediate_size: int, field: str = "moe_intermediate_size") -> ExpertShard | None:
    """This rank's ExpertShard (None on a single rank); ValueError naming `field` when the experts'
    intermediate size does not divide by the number of ranks."""
    state = get_tp_state()
    if state.size == 1:
        return None
    local = divide(intermediate_size, state.size, field)
    return ExpertShard(intermediate_size, state.rank * local, local)
