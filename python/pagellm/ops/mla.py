"""MLA decode and latent-cache writes over the paged latent cache (reference: `ops/mla_reference.py`).

MLA decode with absorbed weights is multi-query attention with one KV head whose keys are the latent rows
and whose values are their first kv_lora_rank dims. `torch.ops.pagellm.paged_mla_decode` is that op: the
paged decode kernels with the latent cache as the one KV head. Which kernel runs:

    CPU:   paged_mla_decode, L a multiple of 16 in [16, 1024]   (DeepSeek-V2/V3: L = 512 + 64 = 576)
    CUDA:  paged_mla_decode for (L, kv_lora_rank) = (576, 512): QK over 576 dims, PV and output over 512;
           other L in {64, 80, 96, 112, 128, 256}: paged_attention_decode over `[num_blocks, 1, block_size, L]`
           views of the cache as both key and value cache, its output's first kv_lora_rank dims kept

Outside those (or without the compiled ops) a masked pure-torch decode runs instead: the padded block table
gathered in chunks with an online softmax, positions >= seq_len masked. Both paths read tensor data only through
ops, so a decode step over them can be captured as a step graph (pagellm.step_graph).
"""

from __future__ import annotations

import torch

from pagellm.ops import mla_reference, ops_available

CPU_MAX_LATENT_DIM = 1024  # the CPU decode kernel's head-dim limit (prefill's is 512)
CUDA_LATENT_DIMS = (64, 80, 96, 112, 128, 256)  # paged_attention_decode's head dims (full-width output)
CUDA_MLA_DIMS = (576, 512)  # (latent_dim, kv_lora_rank) of the CUDA paged_mla_decode kernel (DeepSeek-V2/V3)
MASKED_CHUNK_TOKENS = 2048  # positions per chunk of the pure-torch decode


def _has_kernel(op_name: str, device: torch.device) -> bool:
    if not ops_available()[0] or device.type not in ("cpu", "cuda"):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"pagellm::{op_name}", device.type.upper())


def decode_kernel(device: torch.device, latent_dim: int, kv_lora_rank: int | None = None) -> str | None:
    """The compiled op `paged_mla_decode` runs for this device and these widths ("paged_mla_decode" or
    "paged_attention_decode"), or None for the masked pure-torch decode. kv_lora_rank None: any rank the
    kernels take (for CUDA at 576: 512)."""
    device = torch.device(device)
    if device.type == "cuda":
        rank_ok = kv_lora_rank is None or kv_lora_rank == CUDA_MLA_DIMS[1]
        if latent_dim == CUDA_MLA_DIMS[0] and rank_ok and _has_kernel("paged_mla_decode", device):
            return "paged_mla_decode"
        if latent_dim in CUDA_LATENT_DIMS and _has_kernel("paged_attention_decode", device):
            return "paged_attention_decode"
        return None
    if latent_dim % 16 == 0 and 16 <= latent_dim <= CPU_MAX_LATENT_DIM and _has_kernel("paged_mla_decode", device):
        return "paged_mla_decode"
    return None


def decode_kernel_supported(device: torch.device, latent_dim: int, kv_lora_rank: int | None = None) -> bool:
    """Whether `paged_mla_decode` runs a compiled kernel for this device and these widths."""
    return decode_kernel(device, latent_dim, kv_lora_rank) is not None


def write_latent(latent_cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent_cache [num_blocks, block_size, L] at slot_mapping (int64 [T], -1 = skip) <- rows [T, L]."""
    if not _has_kernel("reshape_and_cache", latent_cache.device):
        mla_reference.write_latent(latent_cache, rows, slot_mapping)
        return
    num_blocks, block_size, latent_dim = latent_cache.shape
    # one KV head whose key and value caches are the same tensor: both writes store the same row
    pages = latent_cache.view(num_blocks, 1, block_size, latent_dim)
    row_heads = rows.contiguous().view(rows.shape[0], 1, latent_dim)
    torch.ops.pagellm.reshape_and_cache.default(pages, pages, row_heads, row_heads, slot_mapping)


def paged_mla_decode(query: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """MLA decode, one query token per sequence at position seq_len - 1.

    query: [T, H, L] (per head [W_UK^T q_nope | q_pe]); latent_cache: [num_blocks, block_size, L];
    block_tables: int32 [T, max_blocks]; seq_lens: int32 [T]. Returns [T, H, kv_lora_rank] (possibly a view):
    softmax(scale * query . latent) @ latent[:, :kv_lora_rank], the same as `mla_reference.paged_mla_decode`.
    """
    num_blocks, block_size, latent_dim = latent_cache.shape
    if query.shape[-1] != latent_dim or not 0 < kv_lora_rank <= latent_dim:
        raise ValueError(f"query last dim {query.shape[-1]} must equal latent_dim {latent_dim} and kv_lora_rank "
                         f"{kv_lora_rank} lie in [1, {latent_dim}]")
    kernel = decode_kernel(query.device, latent_dim, kv_lora_rank)
    if kernel == "paged_mla_decode":
        out = torch.empty((*query.shape[:2], kv_lora_rank), dtype=query.dtype, device=query.device)
        torch.ops.pagellm.paged_mla_decode.default(out, query.contiguous(), latent_cache, block_tables, seq_lens,
                                                   float(scale))
        return out
    if kernel == "paged_attention_decode":
        pages = latent_cache.view(num_blocks, 1, block_size, latent_dim)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        torch.ops.pagellm.paged_attention_decode.default(out, query.contiguous(), pages, pages, block_tables,
                                                         seq_lens, float(scale))
        return out[..., :kv_lora_rank]
    return _masked_decode(query, latent_cache, block_tables, seq_lens, scale, kv_lora_rank)


def _masked_decode(query: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, kv_lora_rank: int,
                   chunk_tokens: int = MASKED_CHUNK_TOKENS) -> torch.Tensor:
    """The padded block table in chunks of about `chunk_tokens` positions, with an online softmax across
    chunks (memory [T, chunk, L], not [T, context, L]); positions past seq_len get zero weight. The chunks
    depend only on the block table's width, so the op sequence is fixed per shape (replayable)."""
    num_seqs, width = block_tables.shape
    block_size, latent_dim = latent_cache.shape[1:]
    q = query.float()
    step = max(1, chunk_tokens // block_size)
    running_max = torch.full(q.shape[:2], float("-inf"), device=q.device)
    denom = torch.zeros(q.shape[:2], device=q.device)
    acc = torch.zeros((*q.shape[:2], kv_lora_rank), device=q.device)
    lens = seq_lens.to(torch.int64)[:, None, None]
    for first in range(0, width, step):
        blocks = block_tables[:, first : first + step]
        latent = latent_cache[blocks.long()].reshape(num_seqs, -1, latent_dim).float()  # [T, n, L]
        positions = first * block_size + torch.arange(latent.shape[1], device=q.device)
        scores = (torch.einsum("thl,tsl->ths", q, latent) * scale).masked_fill(positions >= lens, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1))
        safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)  # no (-inf) - (-inf)
        probs = torch.exp(scores - safe_max[..., None])
        correction = torch.exp(running_max - safe_max)
        denom = denom * correction + probs.sum(dim=-1)
        acc = acc * correction[..., None] + torch.einsum("ths,tsr->thr", probs, latent[..., :kv_lora_rank])
        running_max = new_max
    return (acc / denom[..., None]).to(query.dtype)
