"""Per-layer cache objects (what attention backends receive), their container, and allocation.

    PagedKVCache   full / sliding-window layers: key_cache, value_cache [num_blocks, num_kv_heads, block_size, head_dim]
                   (+ k_scale, v_scale [num_blocks, num_kv_heads, block_size] float32, one per row, for quantized
                   cache dtypes)
    LatentKVCache  MLA layers: cache [num_blocks, block_size, latent_dim] (+ scale [num_blocks, block_size] float32)
    KVCaches       layer id -> cache object; a shared layer's id returns its target's object; a hybrid cache's
                   groups (each with its own block ids and count) copy their blocks apart
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from pagellm import ops
from pagellm.kv_cache.groups import KVCacheConfig
from pagellm.kv_cache.spec import (
    SCALE_DTYPE,
    FullAttentionSpec,
    MLAAttentionSpec,
    SharedKVSpec,
)
from pagellm.ops import reference


def _check_tensor(t: object, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    """A contiguous tensor of `dtype` whose shape matches `shape` past dim 0 (num_blocks)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if tuple(t.shape[1:]) != shape[1:] or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous tensor of shape [num_blocks, {', '.join(map(str, shape[1:]))}], "
                         f"got {tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")


def _check_scales(spec, num_blocks: int, scales: dict[str, torch.Tensor | None]) -> None:
    for name, scale in scales.items():
        if spec.is_quantized and scale is None:
            raise ValueError(f"{name} is required for the quantized cache dtype {spec.dtype!r}")
        if not spec.is_quantized and scale is not None:
            raise ValueError(f"{name} must be None for the float cache dtype {spec.dtype}")
        if scale is not None:
            _check_tensor(scale, spec.scale_shape(num_blocks), SCALE_DTYPE, name)
            if scale.shape[0] != num_blocks:
                raise ValueError(f"{name} must have num_blocks = {num_blocks} rows (the cache's), got {scale.shape[0]}")


@dataclass(eq=False)
class PagedKVCache:
    """One full or sliding-window attention layer's cache (docs/kv_cache_layout.md).

    key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim] of spec.storage_dtype
    k_scale, v_scale:       [num_blocks, num_kv_heads, block_size] float32 when spec.is_quantized (the scale of
                            each cached row: value = stored * scale), else None
    """

    spec: FullAttentionSpec
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.spec, FullAttentionSpec):
            raise TypeError(f"PagedKVCache needs a FullAttentionSpec or SlidingWindowSpec, "
                            f"got {type(self.spec).__name__}")
        shape = self.spec.cache_shape(0)  # dim 0 (num_blocks) is the caller's
        _check_tensor(self.key_cache, shape, self.spec.storage_dtype, "key_cache")
        _check_tensor(self.value_cache, shape, self.spec.storage_dtype, "value_cache")
        if self.value_cache.shape != self.key_cache.shape:
            raise ValueError(f"value_cache shape {tuple(self.value_cache.shape)} must equal key_cache's "
                             f"{tuple(self.key_cache.shape)}")
        _check_scales(self.spec, self.num_blocks, {"k_scale": self.k_scale, "v_scale": self.v_scale})

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[0]

    @property
    def is_quantized(self) -> bool:
        return self.spec.is_quantized

    def tensors(self) -> Iterator[torch.Tensor]:
        yield self.key_cache
        yield self.value_cache
        if self.k_scale is not None:
            yield self.k_scale
            yield self.v_scale


@dataclass(eq=False)
class LatentKVCache:
    """One MLA layer's cache: one latent vector per token, no separate value.

    cache: [num_blocks, block_size, latent_dim] of spec.storage_dtype
    scale: [num_blocks, block_size] float32 when spec.is_quantized (one per token), else None
    """

    spec: MLAAttentionSpec
    cache: torch.Tensor
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.spec, MLAAttentionSpec):
            raise TypeError(f"LatentKVCache needs an MLAAttentionSpec, got {type(self.spec).__name__}")
        _check_tensor(self.cache, self.spec.cache_shape(0), self.spec.storage_dtype, "cache")
        _check_scales(self.spec, self.num_blocks, {"scale": self.scale})

    @property
    def num_blocks(self) -> int:
        return self.cache.shape[0]

    @property
    def is_quantized(self) -> bool:
        return self.spec.is_quantized

    def tensors(self) -> Iterator[torch.Tensor]:
        yield self.cache
        if self.scale is not None:
            yield self.scale


LayerKVCache = PagedKVCache | LatentKVCache


class KVCaches:
    """Every layer's cache object by layer id (`kv_caches[layer_id]`); a shared layer gets its target's object.

    caches: layer id -> the cache object of each layer that owns one
    shared: layer id -> target layer id, for layers that read another layer's cache
    layer_groups: a hybrid cache's layer id -> group index for every owning layer (each group's ids are its
        own: its layers share one num_blocks, other groups may have another); None = one group
    """

    def __init__(self, caches: Mapping[int, LayerKVCache], shared: Mapping[int, int] | None = None,
                 layer_groups: Mapping[int, int] | None = None) -> None:
        if not caches:
            raise ValueError("KVCaches needs at least one layer cache")
        for layer_id, cache in caches.items():
            if not isinstance(cache, (PagedKVCache, LatentKVCache)):
                raise TypeError(f"layer {layer_id}: expected a PagedKVCache or LatentKVCache, "
                                f"got {type(cache).__name__}")
        groups = {i: 0 for i in caches} if layer_groups is None else {i: layer_groups.get(i) for i in caches}
        if any(g is None for g in groups.values()):
            raise ValueError(f"layer_groups must name the group of every owning layer {sorted(caches)}, got "
                             f"{dict(layer_groups or {})}")
        self.num_groups = max(groups.values()) + 1
        self.group_num_blocks: list[int] = []
        for g in range(self.num_groups):
            num_blocks = {c.num_blocks for i, c in caches.items() if groups[i] == g}
            if len(num_blocks) != 1:
                raise ValueError(f"every layer's cache of group {g} must have the same num_blocks (one block id "
                                 f"indexes them all), got {sorted(num_blocks) or 'no layer'}")
            self.group_num_blocks.append(num_blocks.pop())
        shared = dict(shared or {})
        for layer_id, target in shared.items():
            if target not in caches:
                raise ValueError(f"shared layer {layer_id} targets layer {target}, which owns no cache; "
                                 f"owners: {sorted(caches)}")
        self._owned = dict(sorted(caches.items()))
        self._by_layer = {**self._owned, **{i: self._owned[t] for i, t in shared.items()}}
        # every layer's group (a shared layer: its target's), for attention to pick the group's block table
        self.layer_groups = {**groups, **{i: groups[t] for i, t in shared.items()}}
        self.num_blocks = self.group_num_blocks[0]
        self._copies = [_plan_copies([c for i, c in self._owned.items() if groups[i] == g])
                        for g in range(self.num_groups)]

    def __getitem__(self, layer_id: int) -> LayerKVCache:
        try:
            return self._by_layer[layer_id]
        except KeyError:
            raise KeyError(f"no KV cache for layer {layer_id}; layers: {sorted(self._by_layer)}") from None

    def __len__(self) -> int:
        return len(self._by_layer)

    def __contains__(self, layer_id: object) -> bool:
        return layer_id in self._by_layer

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self._by_layer)

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every allocated tensor once (values and scales; shared layers add nothing)."""
        for cache in self._owned.values():
            yield from cache.tensors()

    def copy_blocks(self, block_mapping: torch.Tensor, group: int = 0) -> None:
        """Copy block src -> dst in every allocated tensor (keys, values, latents, scales) of one group (a hybrid
        cache's ids are per group; else the one group holds every layer).

        block_mapping: int64 [num_pairs, 2] of (src, dst) block ids.
        """
        compiled, rest = self._copies[group]
        if not ops.ops_available()[0]:
            # a build without the compiled ops still runs the engine, on the pure-torch reference
            tensors = [t for keys, values in compiled for t in (*keys, *values)] + rest
            reference.copy_blocks(tensors, [], block_mapping)
            return
        for key_caches, value_caches in compiled:
            ops.copy_blocks(key_caches, value_caches, block_mapping)
        if rest:
            reference.copy_blocks(rest, [], block_mapping)


def _plan_copies(caches) -> tuple[list[tuple[list[torch.Tensor], list[torch.Tensor]]], list[torch.Tensor]]:
    """Split the tensors between the compiled copy_blocks op and the reference.

    The op copies whole blocks of paged caches, float or quantized, and of their scales (viewed as
    [num_blocks, num_kv_heads, block_size, 1] pages), one bucket per (shape, dtype) (CUDA: one launch
    each); latent caches go through the reference (index copies).
    """
    buckets: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    rest: list[torch.Tensor] = []

    def add(key: torch.Tensor, value: torch.Tensor) -> None:
        keys, values = buckets.setdefault((tuple(key.shape), key.dtype), ([], []))
        keys.append(key)
        values.append(value)

    for cache in caches:
        if isinstance(cache, PagedKVCache):
            add(cache.key_cache, cache.value_cache)
            if cache.k_scale is not None:
                add(cache.k_scale.unsqueeze(-1), cache.v_scale.unsqueeze(-1))
        else:
            rest.extend(cache.tensors())
    return list(buckets.values()), rest


def allocate_kv_caches(kv_cache_config: KVCacheConfig, device: torch.device) -> KVCaches:
    """Zero-filled caches for every allocating layer of every group, its group's block count each
    (`kv_cache_config.num_blocks` unless the cache is hybrid)."""
    layer_groups = kv_cache_config.layer_groups()
    caches: dict[int, LayerKVCache] = {}
    shared: dict[int, int] = {}
    for layer_id, spec in kv_cache_config.layer_specs.items():
        if isinstance(spec, SharedKVSpec):
            shared[layer_id] = spec.target_layer
        else:
            n = kv_cache_config.num_blocks_of(layer_groups[layer_id])
            caches[layer_id] = _allocate_layer(spec, n, torch.device(device))
    return KVCaches(caches, shared, layer_groups if kv_cache_config.is_hybrid else None)


def _allocate_layer(spec: FullAttentionSpec | MLAAttentionSpec, num_blocks: int, device: torch.device) -> LayerKVCache:
    # zeros, not empty: a backend that multiplies masked-out slots by 0 must not meet NaN garbage
    def zeros(shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=device)

    scale_shape = spec.scale_shape(num_blocks)
    if isinstance(spec, MLAAttentionSpec):
        scale = zeros(scale_shape, SCALE_DTYPE) if spec.is_quantized else None
        return LatentKVCache(spec, zeros(spec.cache_shape(num_blocks), spec.storage_dtype), scale)
    shape = spec.cache_shape(num_blocks)
    k_scale = zeros(scale_shape, SCALE_DTYPE) if spec.is_quantized else None
    v_scale = zeros(scale_shape, SCALE_DTYPE) if spec.is_quantized else None
    return PagedKVCache(spec, zeros(shape, spec.storage_dtype), zeros(shape, spec.storage_dtype), k_scale, v_scale)
