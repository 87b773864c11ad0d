"""Per-layer KV-cache specs: what one layer stores per block, and how many bytes that takes.

A model describes each attention layer with one spec (`CausalLMBase.kv_cache_specs`); groups.py
groups layers whose pages look alike, sizes the cache, and cache.py allocates it. Layouts
(docs/kv_cache_layout.md), per block of `block_size` tokens:

    FullAttentionSpec / SlidingWindowSpec   key, value: [num_kv_heads, block_size, head_dim]
    MLAAttentionSpec                        latent:     [block_size, latent_dim]   (no separate V)
    SharedKVSpec                            nothing: reads `target_layer`'s cache

Cache dtype: a float torch dtype (float32, bfloat16, float16), stored as is, or a quantized cache
dtype name ("int8", "fp8_e4m3"), stored as `storage_dtype` plus one float32 scale per cached row,
i.e. per (token, kv head): k_scale, v_scale `[num_blocks, num_kv_heads, block_size]` (latent: per
token, `[num_blocks, block_size]`). A stored value `q` of slot offset `o` in block `b`, kv head `h`
means `q * scale[b, h, o]`. Per row rather than per block because tokens are written one step at a
time: a block scale fixed by the first token could not hold a later, larger one. Cost: 4 bytes per
row of `head_dim` values (~3 % at head_dim 128 in int8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_CACHE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
# quantized cache dtype name -> storage dtype of the values
QUANTIZED_CACHE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float32
MAX_BLOCK_SIZE = 256  # the paged-attention ops' limit (block_size is a power of two in [1, 256])

def _allowed_dtypes() -> str:
    return ", ".join([*(str(d) for d in FLOAT_CACHE_DTYPES), *(repr(n) for n in QUANTIZED_CACHE_DTYPES)])


def _check_dtype(dtype: object) -> None:
    if isinstance(dtype, torch.dtype) and dtype in FLOAT_CACHE_DTYPES:
        return
    if isinstance(dtype, str) and dtype in QUANTIZED_CACHE_DTYPES:
        return
    raise ValueError(f"KV-cache dtype must be one of {_allowed_dtypes()}; got {dtype!r}")


def _check_int(value: object, name: str, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_block_size(block_size: object) -> None:
    _check_int(block_size, "block_size")
    if block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], got {block_size}")


class _CacheDtypeMixin:
    """storage_dtype / is_quantized / element sizes from a spec's `dtype` field."""

    dtype: torch.dtype | str

    @property
    def is_quantized(self) -> bool:
        return isinstance(self.dtype, str)

    @property
    def storage_dtype(self) -> torch.dtype:
        """dtype of the cache tensors' values (the scales are always SCALE_DTYPE)."""
        return QUANTIZED_CACHE_DTYPES[self.dtype] if isinstance(self.dtype, str) else self.dtype

    @property
    def storage_element_size(self) -> int:
        return torch.empty((), dtype=self.storage_dtype).element_size()


@dataclass(frozen=True)
class FullAttentionSpec(_CacheDtypeMixin):
    """A layer attending over its whole context: key and value pages `[num_kv_heads, block_size, head_dim]`."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype | str

    def __post_init__(self) -> None:
        _check_block_size(self.block_size)
        _check_int(self.num_kv_heads, "num_kv_heads")
        _check_int(self.head_dim, "head_dim")
        _check_dtype(self.dtype)

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of key_cache and of value_cache."""
        return (num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    def scale_shape(self, num_blocks: int) -> tuple[int, int, int]:
        """Shape of k_scale and of v_scale (quantized dtypes only): one float32 per cached row (token, kv head)."""
        return (num_blocks, self.num_kv_heads, self.block_size)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of this layer takes: key + value pages, and their scales when quantized."""
        values = self.num_kv_heads * self.block_size * self.head_dim * self.storage_element_size
        scales = self.num_kv_heads * self.block_size * SCALE_DTYPE.itemsize if self.is_quantized else 0
        return 2 * (values + scales)

    @property
    def page_spec(self) -> "FullAttentionSpec":
        """The storage this layer needs, without its attention semantics (what the layers of a group share)."""
        if type(self) is FullAttentionSpec:
            return self
        return FullAttentionSpec(self.block_size, self.num_kv_heads, self.head_dim, self.dtype)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A layer whose queries see only the last `window_size` keys (themselves included).

    Same pages as full attention: today every block of the context stays allocated (the window is a
    mask in the kernels), so full and sliding-window layers share one group and one block table.
    """

    window_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int(self.window_size, "window_size")


@dataclass(frozen=True)
class MLAAttentionSpec(_CacheDtypeMixin):
    """Multi-head latent attention: one compressed vector per token (kv_lora_rank + rope dims), no separate V.

    Page: `[block_size, latent_dim]`; scale (quantized dtypes): one float32 per token, `[num_blocks, block_size]`.
    """

    block_size: int
    latent_dim: int
    dtype: torch.dtype | str

    def __post_init__(self) -> None:
        _check_block_size(self.block_size)
        _check_int(self.latent_dim, "latent_dim")
        _check_dtype(self.dtype)

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int]:
        return (num_blocks, self.block_size, self.latent_dim)

    def scale_shape(self, num_blocks: int) -> tuple[int, int]:
        return (num_blocks, self.block_size)

    @property
    def page_size_bytes(self) -> int:
        values = self.block_size * self.latent_dim * self.storage_element_size
        return values + (self.block_size * SCALE_DTYPE.itemsize if self.is_quantized else 0)

    @property
    def page_spec(self) -> "MLAAttentionSpec":
        return self


@dataclass(frozen=True)
class SharedKVSpec:
    """A layer that reads layer `target_layer`'s cache (cross-layer KV sharing) and allocates nothing."""

    target_layer: int

    def __post_init__(self) -> None:
        _check_int(self.target_layer, "target_layer", low=0)

    @property
    def page_size_bytes(self) -> int:
        return 0


# A spec that owns pages (every spec but SharedKVSpec).
AttentionPageSpec = FullAttentionSpec | MLAAttentionSpec
KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLAAttentionSpec | SharedKVSpec
