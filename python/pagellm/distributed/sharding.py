"""Shard arithmetic: which part of a full (checkpoint-shaped) tensor one tensor-parallel rank holds.

    column-parallel linear   output rows split evenly: rank r holds rows [r*out/tp, (r+1)*out/tp)
    row-parallel linear      input columns split evenly; the bias stays whole (added once, after the sum)
    attention heads          query heads split evenly; KV heads split evenly, or, when there are fewer KV
                             heads than ranks, each rank holds the one KV head its query heads read
    vocabulary               rows split in ceil(V/tp) blocks; the last rank's block is zero-padded
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or ValueError naming `what` when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


@dataclass(frozen=True)
class HeadPartition:
    """This rank's attention heads: query heads [q_start, q_start + num_heads), KV heads
    [kv_start, kv_start + num_kv_heads) of the full model's."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def partition_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadPartition:
    """Query heads split evenly; KV heads split evenly when num_kv_heads >= size, else replicated (each
    rank keeps the single KV head its query group reads; size must then be a multiple of num_kv_heads)."""
    local_heads = divide(num_heads, size, "num_attention_heads")
    if num_kv_heads >= size:
        local_kv = divide(num_kv_heads, size, "num_key_value_heads")
        return HeadPartition(local_heads, local_kv, rank * local_heads, rank * local_kv)
    if size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({size}) must be a multiple of num_key_value_heads "
                         f"({num_kv_heads}) when it is larger")
    return HeadPartition(local_heads, 1, rank * local_heads, rank // (size // num_kv_heads))


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """(first row, rows held, padded rows per rank): rank r holds rows [start, start + held) of the vocabulary
    in a block of `padded` = ceil(V/size) rows (the rest zero), so every rank's block has the same shape."""
    padded = -(-vocab_size // size)
    start = min(rank * padded, vocab_size)
    return start, max(0, min(vocab_size, start + padded) - start), padded


def narrow_padded(t: torch.Tensor, dim: int, start: int, length: int, padded: int) -> torch.Tensor:
    """t.narrow(dim, start, length), zero-padded along `dim` to `padded`."""
    part = t.narrow(dim, start, length)
    if length == padded:
        return part
    shape = list(t.shape)
    shape[dim] = padded - length
    return torch.cat([part, t.new_zeros(shape)], dim=dim)
