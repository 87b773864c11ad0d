"""Pure-torch reference of paged_tree_attention (re-exported by pagellm.ops.reference).

Kept out of reference.py only for size; same conventions: fp32 math, one rounding into out's dtype.
"""

from __future__ import annotations

import torch

from pagellm.ops.paged_context import gather_context

__all__ = ["paged_tree_attention", "tree_attention_mask"]


def tree_attention_mask(tree_mask: torch.Tensor, context_len: int) -> torch.Tensor:
    """bool [T, context_len + T]: every committed position is visible, then the tree tokens tree_mask [T, T] allows."""
    committed = torch.ones(tree_mask.shape[0], context_len, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([committed, tree_mask.bool()], dim=1)


def paged_tree_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
) -> None:
    """Sequence i's T = qsl[i+1] - qsl[i] tree tokens are the last T of its seq_lens[i] cached positions; token t
    attends to the committed context [0, seq_len - T) and to tree token j iff tree_mask[qsl[i] + t][j]."""
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        num_tree = end - start
        k = gather_context(key_cache, block_tables[i], seq_len).float()  # [L, Hkv, D]
        v = gather_context(value_cache, block_tables[i], seq_len).float()
        group = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
        scores = torch.einsum("thd,lhd->htl", query[start:end].float(), k) * scale  # [Hq, T, L]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        visible = tree_attention_mask(tree_mask[start:end, :num_tree], seq_len - num_tree)  # [T, L]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)  # none visible -> 0
        out[start:end] = torch.einsum("htl,lhd->thd", probs, v).to(out.dtype)
