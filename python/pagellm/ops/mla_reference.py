"""Pure-torch reference of multi-head latent attention (MLA) decode over a paged latent cache.

The yardstick `ops.mla.paged_mla_decode` is tested against, written plainly: one request at a time,
its latent rows gathered through its block table, softmax over every cached position.

    query:         [T, H, L]            float; per head [W_UK^T q_nope (kv_lora_rank) | roped q_pe (rope dims)]
    latent_cache:  [num_blocks, block_size, L]   per token [kv_a_layernorm(c_kv) | roped k_pe]
    block_tables:  int32 [T, max_blocks]; seq_lens: int32 [T] (token t of request t is at position seq_len - 1)
    returns:       [T, H, kv_lora_rank] = softmax(scale * query . latent) @ latent[:, :kv_lora_rank]

The keys are the whole latent rows and the values their first kv_lora_rank dims: with W_UK folded into
the query and W_UV applied after, this is exactly the expanded multi-head attention (see attention/mla.py).
"""

from __future__ import annotations

import torch


def gather_latent(latent_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, L]: position p is row p % block_size of block block_table[p // block_size]."""
    block_size = latent_cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return latent_cache[block_table[:num_blocks].long()].reshape(-1, latent_cache.shape[2])[:seq_len]


def write_latent(latent_cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent_cache[slot // block_size, slot % block_size] = rows[t] ([T, L]); slot -1 is skipped."""
    block_size = latent_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    latent_cache[slots // block_size, slots % block_size] = rows[keep].to(latent_cache.dtype)


def paged_mla_decode(query: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """[T, H, kv_lora_rank] (float32 math, query's dtype out); see the module docstring."""
    out = torch.empty((*query.shape[:2], kv_lora_rank), dtype=query.dtype, device=query.device)
    for t, seq_len in enumerate(seq_lens.tolist()):
        latent = gather_latent(latent_cache, block_tables[t], seq_len).float()  # [S, L]
        scores = (query[t].float() @ latent.t()) * scale                       # [H, S]
        probs = torch.softmax(scores, dim=-1)
        out[t] = (probs @ latent[:, :kv_lora_rank]).to(out.dtype)
    return out
