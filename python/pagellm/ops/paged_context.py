"""Reading one sequence's cached rows through its block table (docs/kv_cache_layout.md), for the references
(`reference.py`, `tree_reference.py`)."""

from __future__ import annotations

import torch


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] of one sequence: position p is row p % block_size of block
    block_table[p // block_size] of cache [num_blocks, num_kv_heads, block_size, head_dim]."""
    block_size = cache.shape[2]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:n_blocks].long()]  # [n, H, bs, D]
    return blocks.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:seq_len]
