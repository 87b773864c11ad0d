"""Argument checks shared by the validating op wrappers (`pagellm.ops`, `ops.quant`, `ops.tree`): each raises
TypeError / ValueError naming the argument, before anything reaches torch.ops.pagellm."""

from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# storage dtypes of quantized KV caches (values; their scales are float32)
_QUANTIZED_CACHE_DTYPES = tuple(d for d in (torch.int8, getattr(torch, "float8_e4m3fn", None)) if d is not None)


def _tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _float(x: object, name: str) -> None:
    if _tensor(x, name).dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def _dtype(x: object, dtype: torch.dtype, name: str) -> None:
    if _tensor(x, name).dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {x.dtype}")


def _ndim(x: torch.Tensor, ndim: int, name: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")


def _same(x: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {x.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name} must be on the device of {ref_name} ({ref.device}), got {x.device}")


def _check_quantized_cache(key_cache, value_cache, k_scale, v_scale) -> None:
    """int8 / float8_e4m3fn caches [num_blocks, num_kv_heads, block_size, head_dim] and float32 scales
    [num_blocks, num_kv_heads, block_size] (one per row)."""
    if _tensor(key_cache, "key_cache").dtype not in _QUANTIZED_CACHE_DTYPES:
        raise TypeError(f"key_cache must have a quantized cache dtype {_QUANTIZED_CACHE_DTYPES}, got {key_cache.dtype}")
    _tensor(value_cache, "value_cache")
    _same(value_cache, key_cache, "value_cache", "key_cache")
    _ndim(key_cache, 4, "key_cache")
    for t, n in ((k_scale, "k_scale"), (v_scale, "v_scale")):
        _dtype(t, torch.float32, n)
        if tuple(t.shape) != tuple(key_cache.shape[:3]):
            raise ValueError(f"{n} shape {tuple(t.shape)} must be [num_blocks, num_kv_heads, block_size] = "
                             f"{tuple(key_cache.shape[:3])} (one scale per cached row)")


def _check_attention(out, query, key_cache, value_cache, block_tables, seq_lens, k_scale=None, v_scale=None) -> None:
    _float(query, "query")
    _tensor(out, "out")
    _same(out, query, "out", "query")
    if k_scale is None:
        for t, n in ((key_cache, "key_cache"), (value_cache, "value_cache")):
            _tensor(t, n)
            _same(t, query, n, "query")
    else:
        _check_quantized_cache(key_cache, value_cache, k_scale, v_scale)
    _ndim(query, 3, "query")
    _ndim(key_cache, 4, "key_cache")
    if out.shape != query.shape:
        raise ValueError(f"out shape {tuple(out.shape)} must equal query shape {tuple(query.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} must equal key_cache's {tuple(key_cache.shape)}")
    if query.shape[2] != key_cache.shape[3] or query.shape[1] % key_cache.shape[1]:
        raise ValueError(
            f"query [tokens, heads, head_dim] = {tuple(query.shape)} does not match key_cache "
            f"[blocks, kv_heads, block_size, head_dim] = {tuple(key_cache.shape)}"
        )
    _dtype(block_tables, torch.int32, "block_tables")
    _dtype(seq_lens, torch.int32, "seq_lens")
