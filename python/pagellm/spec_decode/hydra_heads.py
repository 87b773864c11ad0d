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
        w, b = layer.weight, layer.bias
        key = (w._version, b._version, w.data_ptr(), b.data_ptr())
        cached = self._draft_weights.get(id(layer))
        if cached is None or cached[0] != key:
            cached = (key, w.detach().to(torch.bfloat16).contiguous(), b.detach().to(torch.bfloat16).contiguous())
            self._draft_weights[id(layer)] = cached
        return linear(x, cached[1], cached[2]).float()

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
        hidden [B, H], last_ids [B] -> [B, num_nodes] token ids."""
        lm_head, to_ids = self._lm(lm_head), to_token_ids or (lambda x: x)
        depth = [0] * len(parents)
        for j, p in enumerate(parents):
            depth[j] = 0 if p < 0 else depth[p] + 1
        if max(depth) >= self.num_heads:
            raise ValueError(f"the tree is {max(depth) + 1} deep; these heads draft {self.num_heads}")
        has_children = {p for p in parents if p >= 0}
        max_rank = max(ranks) + 1
        root = self.step(0, hidden.float(), last_ids, draft=True)
        topk = {-1: to_ids(lm_head(root).topk(max_rank, dim=-1).indices)}  # node -> [B, max_rank] its guesses
        states = {-1: root}
        tokens = torch.empty(hidden.shape[0], len(parents), dtype=torch.long)
        for d in range(max(depth) + 1):  # one batched head step per level for the nodes that have children
            level = [j for j in range(len(parents)) if depth[j] == d]
            for j in level:
                tokens[:, j] = topk[parents[j]][:, ranks[j]]
            grow = [j for j in level if j in has_children]
            if not grow:
                continue
            z = self.step(d + 1, torch.cat([states[parents[j]] for j in grow]), torch.cat([tokens[:, j] for j in grow]),
                          draft=True)
            guesses = to_ids(lm_head(z).topk(max_rank, dim=-1).indices).split(hidden.shape[0])
            for j, zj, g in zip(grow, z.split(hidden.shape[0]), guesses):
                states[j], topk[j] = zj, g
        return tokens

    def head_states(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        raise TypeError("Hydra head states depend on the drafted tokens: use teacher_forced or draft_chain")

    def _lm(self, lm_head: LmHead | None) -> LmHead:
        if lm_head is None:
            raise ValueError("Hydra heads share the target's LM head: pass lm_head")
        return lm_head


HEAD_TYPES: dict[str, type[MedusaHeads]] = {"medusa": MedusaHeads, "hydra": HydraHeads}


def load_draft_heads(directory: str | Path, dtype: torch.dtype | None = None) -> MedusaHeads:
    """Medusa or Hydra heads, by medusa_config.json's "head_type" (absent: medusa). ValueError for another type."""
    path = Path(directory).expanduser()
    config = json.loads((path / CONFIG_NAME).read_text()) if (path / CONFIG_NAME).is_file() else {}
    head_type = config.get("head_type", "medusa")
    if head_type not in HEAD_TYPES:
        raise ValueError(f"{str(path)!r}: unknown head_type {head_type!r}; known: {sorted(HEAD_TYPES)}")
    return HEAD_TYPES[head_type].load(path, dtype)
