"""Hydra heads (Ankner et al. 2024): Medusa heads that see the tokens drafted before them, so head i + 1 is
conditioned on head i's choice (sequential drafting, like EAGLE's feature recurrence without its attention).

    z_0 = h_t                                    the target's final normed hidden state (it gave token x_{t+1})
    head i (i = 0 .. K-1):  z_{i+1} = z_i + SiLU(W_i [z_i ; E(x_{t+1+i})] + b_i), then num_layers - 1 ResBlocks
                            LM head(z_{i+1}) -> logits of token x_{t+2+i}

E is the target's input embedding (looked up, never trained); x_{t+1} is the token the target just sampled,
x_{t+1+i} for i >= 1 the draft head i - 1 chose (serving) or the text's token (training: teacher forcing, which
is exactly the case a chain's draft i is judged in, every earlier draft being right). W_i starts at zero: an
untrained head passes h_t through, like a fresh Medusa ResBlock.

Why: a Medusa head guesses x_{t+2} from h_t without knowing x_{t+1}. On SmolLM2-135M's own chat answers (session 14)
held-out top-1 went from 0.27 / 0.16 / 0.12 (Medusa) to 0.39 / 0.22 / 0.14, the served chain's mean accepted length
from 1.30 to 1.51; and a tree's nodes follow their parents.

Only the shared-LM-head layout exists (CPU: the target's LM head or a draft vocabulary's rows of it).

On disk (the Medusa directory layout, medusa_heads.py):
    medusa_lm_head.safetensors   hydra_head.{i}.0.linear.weight [H, 2H] (input [z ; E(token)]), .bias [H];
                                 hydra_head.{i}.{j}.linear.weight [H, H], .bias [H] for 1 <= j < num_layers;
                                 `draft_vocab` int64 [S] when drafting scores a draft vocabulary
    medusa_config.json           the Medusa keys + "head_type": "hydra"
The embedding is not stored: the proposer reads it from the target's checkpoint (`set_embedding`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from pagellm.ops.linear_dispatch import linear
from pagellm.sampling.processors import argmax_rows
from pagellm.spec_decode.medusa_heads import CONFIG_NAME, MedusaHeads, ResBlock

LmHead = Callable[[torch.Tensor], torch.Tensor]


class TokenResBlock(nn.Module):
    """z + SiLU(W [z ; e] + b): ([..., H], [..., H]) -> [..., H]; W [H, 2H] starts at zero (identity on z)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(2 * hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, z: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return z + F.silu(_affine(self.linear, torch.cat([z, e], dim=-1)))


def _affine(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x W^T + b through pagellm's CPU linear kernels when drafting (F.linear under autograd): torch's fp32 and
    bf16 GEMMs alternating at batch 1 (head, LM head, head, ...) made a 3-head chain ~17 ms on the 2-core EPYC,
    pagellm's kernels ~0.5 ms (measured, session 14)."""
    return linear(x, layer.weight, layer.bias)


class HydraHeads(MedusaHeads):
    """K sequential heads (module doc). `hydra_head[i]` is a ModuleList: a TokenResBlock, then ResBlocks.
    Call `set_embedding` (the target's input embedding [V, H]) before drafting or training."""

    head_type = "hydra"

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 3, num_layers: int = 1,
                 share_lm_head: bool = True, base_model: str | None = None, base_model_hash: str | None = None) -> None:
        if not share_lm_head:
            raise ValueError("Hydra heads share the target's LM head (share_lm_head=True); own LM heads are Medusa's")
        super().__init__(hidden_size, vocab_size, num_heads, num_layers, True, base_model, base_model_hash)
        self.embed_weight: torch.Tensor | None = None  # set_embedding: [V, H] bf16, not a parameter
        self._draft_weights: dict[int, tuple] = {}  # id(linear) -> (parameter versions, bf16 W, bf16 b): drafting

    def _build_heads(self) -> None:
        self.hydra_head = nn.ModuleList(
            nn.ModuleList([TokenResBlock(self.hidden_size)] + [ResBlock(self.hidden_size)
                                                                for _ in range(self.num_layers - 1)])
            for _ in range(self.num_heads))

    def set_embedding(self, weight: torch.Tensor) -> None:
        """The target's input embedding [V, H], kept in bf16 (the trainer and the proposer look up the same values)."""
        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"embedding must be [{self.vocab_size}, {self.hidden_size}], got {list(weight.shape)}")
        self.embed_weight = weight.detach().to(torch.bfloat16).contiguous()

    # ------------------------------------------------------------------ compute
    def step(self, i: int, z: torch.Tensor, token_ids: torch.Tensor, draft: bool = False) -> torch.Tensor:
        """Head i: state z [N, H] and the token before its guess [N] -> its state [N, H] (the LM head's input).
        `draft` (drafting and the trainer's served evaluation, no autograd): the products in bf16 (bf16 copies of
        the weights, fp32 accumulation; the state and the SiLU stay fp32), ~0.6x the fp32 product's time at batch 1."""
        if self.embed_weight is None:
            raise ValueError("Hydra heads need the target's embedding: call set_embedding first")
        blocks = self.hydra_head[i]
        if draft:
            z = z + F.silu(self._draft_affine(blocks[0].linear, torch.cat([z.to(torch.bfloat16),
                                                                           self.embed_weight[token_ids]], dim=-1)))
            for block in list(blocks)[1:]:
                z = z + F.silu(self._draft_affine(block.linear, z.to(torch.bfloat16)))
            return z
        z = blocks[0](z, self.embed_weight[token_ids].to(z.dtype))
        for block in list(blocks)[1:]:
            z = z + F.silu(_affine(block.linear, z))  # a ResBlock (same parameters and names)
        return z

    def _draft_affine(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """x [N, K] bf16 -> (x W^T + b) [N, H] fp32 through bf16 copies of W, b, remade whenever the parameters change
        (their version counters: an optimizer step, load_state_dict) so that a training's evaluation drafts with the
        weights of the moment."""
        _, w, b = self._draft_weight(layer)
        return linear(x, w, b).float()

    def _draft_weight(self, layer: nn.Linear) -> tuple:
        w, b = layer.weight, layer.bias
        key = (w._version, b._version, w.data_ptr(), b.data_ptr())
        cached = self._draft_weights.get(id(layer))
        if cached is None or cached[0] != key:
            cached = (key, w.detach().to(torch.bfloat16).contiguous(), b.detach().to(torch.bfloat16).contiguous())
            self._draft_weights[id(layer)] = cached
        return cached

    def prepare_drafting(self) -> None:
        """Make every head's bf16 drafting weights now (a step graph of drafting reads them as constants)."""
        self.drafting_weights()

    def drafting_weights(self) -> list[list[torch.Tensor]]:
        """Per head, the bf16 weights and biases its drafting step reads, in reading order (made if need be)."""
        return [[t for block in blocks for t in self._draft_weight(block.linear)[1:]] for blocks in self.hydra_head]

    def teacher_forced(self, hidden: torch.Tensor, input_ids: torch.Tensor | None,
                       lm_head: LmHead | None = None, num_heads: int | None = None) -> torch.Tensor:
        """hidden [N, H], input_ids [N, >= k] (x_{t+1} .. x_{t+k}: the text's tokens) -> [N, k, S] logits."""
        k = self._count(num_heads)
        if input_ids is None or input_ids.shape[-1] < k:
            raise ValueError(f"Hydra heads need the {k} tokens before their guesses (input_ids [N, {k}])")
        lm_head = self._lm(lm_head)
        z, out = hidden, []
        for i in range(k):
            z = self.step(i, z, input_ids[:, i])
            out.append(lm_head(z))
        return torch.stack(out, dim=1)

    def forward(self, hidden: torch.Tensor, lm_head: LmHead | None = None, num_heads: int | None = None,
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.teacher_forced(hidden, input_ids, lm_head, num_heads)

    @torch.no_grad()
    def draft_chain(self, hidden: torch.Tensor, last_ids: torch.Tensor, lm_head: LmHead | None = None,
                    num_heads: int | None = None, to_token_ids: Callable | None = None) -> torch.Tensor:
        """Greedy sequential drafting: hidden [B, H], last_ids [B] (x_{t+1}) -> [B, k] draft token ids, each
        head fed the previous head's top-1. `to_token_ids`: the LM head's indices -> token ids (draft vocabulary)."""
        k = self._count(num_heads)
        lm_head, to_ids = self._lm(lm_head), to_token_ids or (lambda x: x)
        z, tok, out = hidden.float(), last_ids, []
        for i in range(k):
            z = self.step(i, z, tok, draft=True)
            tok = to_ids(argmax_rows(lm_head(z)))  # the argmax op: torch's CPU argmax took ~35 us of 8192 logits
            out.append(tok)
        return torch.stack(out, dim=1)

    @torch.no_grad()
    def draft_tree(self, hidden: torch.Tensor, last_ids: torch.Tensor, parents: Sequence[int], ranks: Sequence[int],
                   lm_head: LmHead | None = None, to_token_ids: Callable | None = None) -> torch.Tensor:
        """A candidate tree's tokens: node j is the ranks[j]-th most likely guess of its parent's head state
        (parents[j] = -1: the root, h_t after x_{t+1}); nodes in any order with parents first (MedusaTree's).
        hidden [B, H], last_ids [B] -> [B, num_nodes] token ids. One batched head step, LM-head call and top-k per
        level (the nodes that have children), the level's inputs and the tree's tokens gathered by indices computed
        once per tree shape (`tree_plan`): a served step runs this right after the target's forward has streamed its
        weights through the caches, where each torch op costs ~10-30 us of cold code and data (session 18)."""
        lm_head, to_ids = self._lm(lm_head), to_token_ids or (lambda x: x)
        plan = tree_plan(tuple(int(p) for p in parents), tuple(int(r) for r in ranks))
        if plan.depth > self.num_heads:
            raise ValueError(f"the tree is {plan.depth} deep; these heads draft {self.num_heads}")
        b = hidden.shape[0]
        z, tok = hidden.float(), last_ids
        guesses = []  # per level: [num_grown * B, max_rank] token ids
        for level in range(len(plan.grown)):
            if level:  # the level's inputs: its grown nodes' tokens and their parents' states
                prev = guesses[-1]
                tok = prev.view(-1)[_token_index(plan.input_tokens[level], b, plan.max_rank, False)]
                if plan.state_groups[level] is not None:
                    z = z.view(-1, b, z.shape[-1])[plan.state_groups[level]].reshape(-1, z.shape[-1])
            z = self.step(level, z, tok, draft=True)
            guesses.append(to_ids(lm_head(z).topk(plan.max_rank, dim=-1).indices))
        flat = guesses[0] if len(guesses) == 1 else torch.cat(guesses)
        return flat.view(-1)[_token_index(plan.node_tokens, b, plan.max_rank, True)]

    def head_states(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        raise TypeError("Hydra head states depend on the drafted tokens: use teacher_forced or draft_chain")

    def _lm(self, lm_head: LmHead | None) -> LmHead:
        if lm_head is None:
            raise ValueError("Hydra heads share the target's LM head: pass lm_head")
        return lm_head


@dataclass(frozen=True)
class TreePlan:
    """How `HydraHeads.draft_tree` drafts one tree shape, level by level: level d runs head d on the states of the
    nodes at depth d - 1 that have children (level 0: the root, h_t). A level's guesses are [num_grown * B, max_rank]
    token ids, grown nodes one after another; a token is named by (group, rank): the grown node that guessed it
    (numbered over all levels for the tree's tokens, within the previous level for a level's inputs) and its rank."""

    depth: int
    max_rank: int
    grown: tuple[tuple[int, ...], ...]  # per level: the nodes whose states it computes (level 0: (-1,), the root)
    input_tokens: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]  # per level >= 1: its grown nodes' tokens
    state_groups: tuple[torch.Tensor | None, ...]  # per level >= 1: each grown node's parent group (None: in order)
    node_tokens: tuple[torch.Tensor, torch.Tensor]  # [num_nodes] (group, rank) of each node's token


@lru_cache(maxsize=64)
def tree_plan(parents: tuple[int, ...], ranks: tuple[int, ...]) -> TreePlan:
    """The drafting plan of a tree shape (ValueError for a parent after its child or a negative rank)."""
    if len(parents) != len(ranks) or not parents:
        raise ValueError("parents and ranks must be non-empty and of one length")
    depth: list[int] = []
    for j, p in enumerate(parents):
        if not -1 <= p < j or ranks[j] < 0:
            raise ValueError(f"node {j}: parent {p} must come before it, rank {ranks[j]} must be >= 0")
        depth.append(0 if p < 0 else depth[p] + 1)
    has_children = {p for p in parents if p >= 0}
    grown: list[tuple[int, ...]] = [(-1,)]
    while True:  # the next level's grown nodes: this level's children that have children
        nxt = tuple(j for j in range(len(parents)) if depth[j] == len(grown) - 1 and j in has_children)
        if not nxt:
            break
        grown.append(nxt)
    offset, where = 0, {}  # node -> (its group over all levels, its group within its level)
    for g in grown:
        for i, j in enumerate(g):
            where[j] = (offset + i, i)
        offset += len(g)

    def pair(groups: list[int], node_ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(groups, dtype=torch.long), torch.tensor(node_ranks, dtype=torch.long)

    input_tokens: list = [None]
    state_groups: list = [None]
    for level in range(1, len(grown)):
        groups = [where[parents[j]][1] for j in grown[level]]
        input_tokens.append(pair(groups, [ranks[j] for j in grown[level]]))
        state_groups.append(None if groups == list(range(len(grown[level - 1]))) else torch.tensor(groups))
    return TreePlan(max(depth) + 1, max(ranks) + 1, tuple(grown), tuple(input_tokens), tuple(state_groups),
                    pair([where[p][0] for p in parents], list(ranks)))


def _token_index(groups_ranks: tuple[torch.Tensor, torch.Tensor], batch: int, max_rank: int,
                 batch_major: bool) -> torch.Tensor:
    """Flat indices into guesses laid out [groups * B, max_rank]: [B, n] (batch_major) or [n * B] group-major."""
    groups, ranks = groups_ranks
    if batch == 1:
        index = groups * max_rank + ranks
        return index[None, :] if batch_major else index
    rows = torch.arange(batch)
    if batch_major:
        return (groups[None, :] * batch + rows[:, None]) * max_rank + ranks[None, :]
    return ((groups[:, None] * batch + rows[None, :]) * max_rank + ranks[:, None]).reshape(-1)


HEAD_TYPES: dict[str, type[MedusaHeads]] = {"medusa": MedusaHeads, "hydra": HydraHeads}


def load_draft_heads(directory: str | Path, dtype: torch.dtype | None = None) -> MedusaHeads:
    """Medusa or Hydra heads, by medusa_config.json's "head_type" (absent: medusa). ValueError for another type."""
    path = Path(directory).expanduser()
    config = json.loads((path / CONFIG_NAME).read_text()) if (path / CONFIG_NAME).is_file() else {}
    head_type = config.get("head_type", "medusa")
    if head_type not in HEAD_TYPES:
        raise ValueError(f"{str(path)!r}: unknown head_type {head_type!r}; known: {sorted(HEAD_TYPES)}")
    return HEAD_TYPES[head_type].load(path, dtype)
