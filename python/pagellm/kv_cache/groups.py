"""Grouping the layers' KV-cache specs, and sizing the cache from memory.

A `KVCacheGroup` is a set of layers whose pages look alike (same `page_spec`: block size, heads,
head/latent dim, cache dtype) and that share one block table. Full and sliding-window layers of the
same shape are one group (the window is a mask; every block stays allocated). Shared layers join
their target's group and allocate nothing.

One block id indexes a page in every allocated layer of every group, so one block costs
`KVCacheConfig.bytes_per_block` = the sum of every group's pages. That works for any mix of page
shapes with one tokens-per-block, because the C++ block manager keeps ONE block table per request
today. Groups that need their own block tables (a different block_size, or a sliding-window group
that frees blocks that left its window) will need one table per group there; until then
`make_kv_cache_config` refuses them (`KVCacheConfig.num_block_tables` > 1) with a ValueError.

A model whose every layer is a SlidingWindowSpec with one window (Mistral, Qwen2 with a sliding window
on all layers) frees its blocks already: `KVCacheConfig.sliding_window` goes to the C++ block manager,
which after each step replaces the table entries of blocks entirely before `num_computed - window + 1`
by a reserved null block (the table keeps its length), releases them (still hashed) and admits by the
window (a request holds at most ceil((window - 1 + chunk) / block_size) + 1 blocks); prefix hits need
only the window's blocks. Kernels need nothing new: null entries lie before every query's window.

Freeing a sliding layer's blocks in a MIXED model (Gemma 2/3: sliding and full layers) needs, in order:
1. storage: a block id indexes a page in EVERY layer here, so freeing it for the sliding layers would
   free it for the full ones too. Sliding and full layers need separate block ids: per-group pools
   (own tensors, own free queues), or one pool whose ids each hold a page of one group only.
2. C++ BlockManager: one block table per (request, group), each group with its own window. The per-table
   mechanism exists (csrc/core/block_manager: the null block, drop_outside_window after each step,
   max_live_blocks for admission, the right-to-left prefix scan); what is missing is several tables per
   request, admission / the watermark / preemption summed over groups, and CoW pairs naming their group.
3. prefix cache: each group's hit as above; the request's hit length is the minimum over groups.
4. SchedulerOutput carries one block-table array and one slot mapping per group (the ids differ), so does
   AttentionMetadata, each layer's backend call reads its group's, and step-graph replay copies them all. Kernels need nothing new: null entries are masked.
Until then a mixed model's window is a mask and a sliding layer's blocks live as long as the request.

Budget (`determine_num_blocks`): `kv_cache_memory_gb` when given, else `kv_cache_fraction` of the
memory still free after the weights were loaded (CUDA: torch.cuda.mem_get_info; CPU: MemAvailable in
/proc/meminfo, capped at CPU_DEFAULT_MAX_GB), or exactly `num_kv_blocks` when set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import torch

from pagellm.kv_cache.spec import (
    AttentionPageSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SharedKVSpec,
    SlidingWindowSpec,
)
from pagellm.logger import init_logger

logger = init_logger(__name__)
GiB = 1 << 30
CPU_DEFAULT_MAX_GB = 4


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one page shape and one block table.

    layer_ids:        every member, ascending (shared layers included)
    spec:             the page every allocating member stores per block (its specs' `page_spec`)
    shared_layer_ids: members that read another member's cache (SharedKVSpec) and allocate nothing
    """

    layer_ids: tuple[int, ...]
    spec: AttentionPageSpec
    shared_layer_ids: tuple[int, ...] = ()

    @property
    def allocated_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in self.layer_ids if i not in self.shared_layer_ids)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block id takes in this group: one page per allocating layer."""
        return len(self.allocated_layer_ids) * self.spec.page_size_bytes


@dataclass(frozen=True)
class KVCacheConfig:
    """The whole cache: `num_blocks` block ids, each indexing one page in every allocated layer of every group.

    layer_specs: layer id -> that layer's spec (attention semantics such as the window live here;
    the groups only describe storage).
    """

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]
    layer_specs: Mapping[int, KVCacheSpec]
    # False: keep every block even when these layers all slide (a pipeline stage sees only its own layers, but
    # the driver's one block manager serves every stage, whose other layers may be full attention)
    free_sliding_blocks: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        if not self.groups:
            raise ValueError("a KVCacheConfig needs at least one group")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_block_tables(self) -> int:
        """Distinct block tables a request needs (the C++ block manager supports 1)."""
        return len({g.block_size for g in self.groups})

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def sliding_window(self) -> int:
        """The block manager's window (see `block_manager_window`); 0 = every block lives as long as its request."""
        return block_manager_window(self.layer_specs) if self.free_sliding_blocks else 0

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.groups)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes one token of context takes over every layer (scales included): bytes_per_block /
        block_size."""
        return self.bytes_per_block // self.block_size

    def describe_bytes_per_token(self) -> str:
        """'N bytes per token (layers: x full, y sliding, z MLA, w shared)', for start-up logs."""
        counts = count_layer_kinds(self.layer_specs)
        kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items())
        return f"{self.bytes_per_token} bytes per token (layers: {kinds})"


def count_layer_kinds(layer_specs: Mapping[int, KVCacheSpec]) -> dict[str, int]:
    """Layers per kind of cache: {"full", "sliding", "MLA", "shared"} -> count."""
    kinds = {"full": FullAttentionSpec, "sliding": SlidingWindowSpec, "MLA": MLAAttentionSpec, "shared": SharedKVSpec}
    return {kind: sum(type(s) is cls for s in layer_specs.values()) for kind, cls in kinds.items()}


def kv_bytes_per_token(layer_specs: Mapping[int, KVCacheSpec]) -> int:
    """KV-cache bytes per token of context for these layer specs (no sizing, no memory needed)."""
    groups = group_kv_cache_specs(layer_specs)
    return bytes_per_block(groups) // groups[0].block_size


def group_kv_cache_specs(layer_specs: Mapping[int, KVCacheSpec]) -> tuple[KVCacheGroup, ...]:
    """Group layers by page shape, in order of their first layer; shared layers join their target's group.

    Raises TypeError for a value that is not a spec, ValueError for bad layer ids or shared targets.
    """
    _check_layer_specs(layer_specs)
    members: dict[AttentionPageSpec, list[int]] = {}
    shared: dict[AttentionPageSpec, list[int]] = {}
    for layer_id in sorted(layer_specs):
        spec = layer_specs[layer_id]
        if isinstance(spec, SharedKVSpec):
            page = layer_specs[spec.target_layer].page_spec
            shared.setdefault(page, []).append(layer_id)
        else:
            page = spec.page_spec
        members.setdefault(page, []).append(layer_id)
    return tuple(
        KVCacheGroup(layer_ids=tuple(ids), spec=page, shared_layer_ids=tuple(shared.get(page, ())))
        for page, ids in sorted(members.items(), key=lambda kv: kv[1][0])
    )


def _check_layer_specs(layer_specs: Mapping[int, KVCacheSpec]) -> None:
    if not isinstance(layer_specs, Mapping) or not layer_specs:
        raise ValueError(f"layer_specs must be a non-empty mapping layer id -> spec, got {layer_specs!r}")
    for layer_id, spec in layer_specs.items():
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id < 0:
            raise ValueError(f"layer ids must be integers >= 0, got {layer_id!r}")
        if not isinstance(spec, (FullAttentionSpec, MLAAttentionSpec, SharedKVSpec)):
            raise TypeError(f"layer {layer_id}: expected a FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec or "
                            f"SharedKVSpec, got {type(spec).__name__}")
        if isinstance(spec, SharedKVSpec):
            target = layer_specs.get(spec.target_layer)
            if target is None:
                raise ValueError(f"layer {layer_id} shares the cache of layer {spec.target_layer}, which does not "
                                 f"exist; layers: {sorted(layer_specs)}")
            if isinstance(target, SharedKVSpec):
                raise ValueError(f"layer {layer_id} shares the cache of layer {spec.target_layer}, which is itself "
                                 f"shared; point at the layer that owns the cache (layer {target.target_layer})")


def block_manager_window(layer_specs: Mapping[int, KVCacheSpec]) -> int:
    """The window W the block manager may free blocks by: every layer is a SlidingWindowSpec of window W
    (one block table serves every layer, so one full or shared layer keeps every block); else 0."""
    windows = {s.window_size if type(s) is SlidingWindowSpec else 0 for s in layer_specs.values()}
    return windows.pop() if len(windows) == 1 else 0


def max_blocks_per_request(block_size: int, max_model_len: int, window: int, max_chunk_tokens: int) -> int:
    """Most blocks one request holds at once: all of a max-length request's without a window, else those a
    window plus the longest chunk can span (the C++ BlockManager::max_live_blocks)."""
    all_blocks = math.ceil(max_model_len / block_size)
    if window == 0:
        return all_blocks
    return min(all_blocks, math.ceil((window - 1 + max_chunk_tokens) / block_size) + 1)


def bytes_per_block(groups: Sequence[KVCacheGroup]) -> int:
    """Bytes one block id takes over every group (every allocated layer's page, scales included)."""
    return sum(g.page_size_bytes for g in groups)


def check_one_block_table(groups: Sequence[KVCacheGroup]) -> None:
    """Raise ValueError when the groups need more than one block table per request (not supported yet)."""
    if not groups:
        raise ValueError("no KV-cache groups: the model has no attention layers")
    block_sizes = sorted({g.block_size for g in groups})
    if len(block_sizes) > 1:
        described = "; ".join(f"layers {list(g.layer_ids)}: {g.spec}" for g in groups)
        raise ValueError(
            f"this model's KV cache needs {len(block_sizes)} block tables per request (block sizes {block_sizes}), "
            f"but the block manager keeps one per request; give every layer the same block_size. Groups: {described}"
        )


def available_memory_bytes(device: torch.device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * GiB  # unknown: assume a modest machine


def _memory_budget(device: torch.device, kv_cache_memory_gb: float | None, kv_cache_fraction: float) -> tuple[int, str]:
    """(bytes, where they came from) for the cache."""
    if kv_cache_memory_gb is not None:
        return int(kv_cache_memory_gb * GiB), f"kv_cache_memory_gb={kv_cache_memory_gb}"
    free = available_memory_bytes(device)
    budget = int(free * kv_cache_fraction)
    source = f"kv_cache_fraction={kv_cache_fraction} of {free / GiB:.2f} GiB free"
    if torch.device(device).type == "cpu" and budget > CPU_DEFAULT_MAX_GB * GiB:
        # host memory is shared with everything else: cap unless asked explicitly
        budget = CPU_DEFAULT_MAX_GB * GiB
        source += f", capped at {CPU_DEFAULT_MAX_GB} GiB on CPU (set kv_cache_memory_gb for more)"
    return budget, source


def determine_num_blocks(groups: Sequence[KVCacheGroup], device: torch.device, max_model_len: int, max_num_seqs: int,
                         kv_cache_memory_gb: float | None = None, kv_cache_fraction: float = 0.9,
                         num_blocks_override: int | None = None, sliding_window: int = 0,
                         max_chunk_tokens: int | None = None) -> int:
    """Blocks that fit the budget (capped at what max_num_seqs max-length requests can hold at once), one
    block costing `bytes_per_block(groups)`. With a block-manager `sliding_window` a request holds at most
    the blocks its window and its longest chunk (`max_chunk_tokens`, default max_model_len) span.

    Raises ValueError with a suggested setting when one max-length request does not fit.
    """
    check_one_block_table(groups)
    per_block = bytes_per_block(groups)
    block_size = groups[0].block_size
    chunk = max_model_len if max_chunk_tokens is None else min(max_chunk_tokens, max_model_len)
    blocks_per_seq = max_blocks_per_request(block_size, max_model_len, sliding_window, chunk)
    if num_blocks_override is not None:
        num_blocks = int(num_blocks_override)
        source = "num_kv_blocks"
    else:
        budget, source = _memory_budget(device, kv_cache_memory_gb, kv_cache_fraction)
        num_blocks = budget // per_block
        # never more than every sequence slot at full length can use (+1 for the null block)
        num_blocks = min(num_blocks, blocks_per_seq * max_num_seqs + 1)
    if num_blocks < blocks_per_seq + 1:
        need_gb = (blocks_per_seq + 1) * per_block / GiB
        fit_len = max(0, (num_blocks - 1) * block_size)
        raise ValueError(
            f"the KV cache ({source}: {num_blocks} blocks of {block_size} tokens) cannot hold one "
            f"request of max_model_len={max_model_len} tokens ({blocks_per_seq + 1} blocks needed). "
            f"Set kv_cache_memory_gb >= {need_gb:.3f} or max_model_len <= {fit_len}."
        )
    if sliding_window:  # the null block is never a request's
        max_concurrency = (num_blocks - 1) / blocks_per_seq
    else:
        max_concurrency = (num_blocks * block_size) / max_model_len
    logger.info(
        "KV cache: %d blocks x %d tokens (%.3f GiB, %s); max concurrency %.2fx requests of %d tokens",
        num_blocks, block_size, num_blocks * per_block / GiB, source, max_concurrency, max_model_len,
    )
    return num_blocks


def make_kv_cache_config(layer_specs: Mapping[int, KVCacheSpec], device: torch.device, max_model_len: int,
                         max_num_seqs: int, kv_cache_memory_gb: float | None = None, kv_cache_fraction: float = 0.9,
                         num_blocks_override: int | None = None, max_chunk_tokens: int | None = None,
                         free_sliding_blocks: bool = True) -> KVCacheConfig:
    """Group the layers, refuse what the block manager cannot serve yet, size: the engine's one call.
    `max_chunk_tokens`: the scheduler's longest step per request (sizing with a sliding window).
    `free_sliding_blocks`: False when `layer_specs` are not the whole model's (a pipeline stage)."""
    groups = group_kv_cache_specs(layer_specs)
    config = KVCacheConfig(num_blocks=1, groups=groups, layer_specs=dict(layer_specs),
                           free_sliding_blocks=free_sliding_blocks)
    num_blocks = determine_num_blocks(groups, device, max_model_len, max_num_seqs, kv_cache_memory_gb,
                                      kv_cache_fraction, num_blocks_override, config.sliding_window, max_chunk_tokens)
    return replace(config, num_blocks=num_blocks)
