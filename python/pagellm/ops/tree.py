"""paged_tree_attention: attention of a batch of candidate token trees (Medusa-style speculative verification)
over the paged KV cache, and the tree-mask builder. Re-exported by pagellm.ops; reference:
pagellm.ops.reference.paged_tree_attention (pagellm/ops/tree_reference.py).

Tree layout (per sequence i, tokens qsl[i] .. qsl[i+1]-1 of the call): the T_i tree tokens' K/V are already in the
cache (reshape_and_cache with their slots) at positions seq_lens[i] - T_i .. seq_lens[i] - 1, in tree order (node j
at position seq_lens[i] - T_i + j). The model gives node j the rotary position context_len + depth(j) (tree
position ids); the cache position only says where its K/V row lives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagellm.ops.arg_checks import _check_attention, _dtype

__all__ = ["paged_tree_attention", "tree_mask_from_parents", "tree_depths"]


def tree_mask_from_parents(parents: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [n, n] ancestor mask of a tree given as parents[j] (-1 = a child of the committed context, i.e. a root):
    mask[i][j] = node j is node i or one of its ancestors. Parents must come before their children (parents[j] < j)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"parents[{j}] = {p} must be -1 (root) or an earlier node in [0, {j})")
        if p >= 0:
            mask[j] |= mask[p]
    return mask.to(device)


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (roots: 0); the tree position id of node j is context_len + depth[j]."""
    depths: list[int] = []
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"parents[{j}] = {p} must be -1 (root) or an earlier node in [0, {j})")
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


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
    """out [num_tokens, num_heads, head_dim] = attention of each tree token over its sequence's paged context.

    query / out: [num_tokens, num_heads, head_dim] (float32 / bfloat16 / float16; num_heads a multiple of the
    cache's num_kv_heads). key_cache / value_cache: float caches of query's dtype (docs/kv_cache_layout.md;
    quantized caches are not supported). block_tables int32 [num_seqs, max_blocks]; query_start_loc int32
    [num_seqs + 1] (sequence i's tree tokens are rows qsl[i] .. qsl[i+1]-1); seq_lens int32 [num_seqs] = committed
    context + tree tokens. tree_mask bool / uint8 [num_tokens, max_tree_tokens]: row t, column j says whether tree
    token j of t's sequence is visible to t (its ancestors and itself: tree_mask_from_parents); columns past a
    sequence's T_i are ignored. Every committed position is visible to every tree token. A token that sees nothing
    (no context, empty mask row) gets zeros.
    """
    _check_attention(out, query, key_cache, value_cache, block_tables, seq_lens)
    _dtype(query_start_loc, torch.int32, "query_start_loc")
    if not isinstance(tree_mask, torch.Tensor):
        raise TypeError(f"tree_mask must be a torch.Tensor, got {type(tree_mask).__name__}")
    if tree_mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"tree_mask must be bool or uint8, got {tree_mask.dtype}")
    if tree_mask.dim() != 2 or tree_mask.shape[0] != query.shape[0]:
        raise ValueError(
            f"tree_mask must have shape [num_tokens = {query.shape[0]}, max_tree_tokens], got {tuple(tree_mask.shape)}"
        )
    torch.ops.pagellm.paged_tree_attention(
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, tree_mask, float(scale),
        float(softcap),
    )  # fmt: skip
