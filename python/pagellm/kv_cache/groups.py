"""Grouping the layers' KV-cache specs, and sizing the cache from memory.

A `KVCacheGroup` is a set of layers whose pages look alike (same `page_spec`: block size, heads,
head/latent dim, cache dtype) and that share one block table. Shared layers join their target's group
and allocate nothing.

One group set per model, two ways to give out block ids:

- Shared ids (every model but a mixed one; `KVCacheConfig.is_hybrid` False): one block id indexes a page
  in every allocated layer of every group, so one block costs `bytes_per_block` = the sum of every
  group's pages, and the C++ scheduler keeps ONE block table per request. Full and sliding-window layers
  of one shape are one group. A model whose every layer is a SlidingWindowSpec with one window (Mistral,
  Qwen2 with a window on all layers) frees its blocks: `KVCacheConfig.sliding_window` goes to the C++
  block manager, which after each step replaces the table entries of blocks entirely before
  `num_computed - window + 1` by a reserved null block (the table keeps its length), releases them (still
  hashed) and admits by the window (a request holds at most ceil((window - 1 + chunk) / block_size) + 1
  blocks); prefix hits need only the window's blocks.

- A hybrid cache (a MIXED model, `is_mixed_window_model`: Gemma 2/3's local and global layers, Qwen2
  with `max_window_layers`, several windows): `group_kv_cache_specs(split_windows=True)` puts the layers
  of each window in a group of their own (`KVCacheGroup.sliding_window`), the others in theirs, and
  every group gets its OWN block ids (`KVCacheConfig.group_num_blocks`), like vLLM's hybrid KV cache
  manager:
  1. storage: per-group pools. Each layer's tensors hold its group's block count (`allocate_kv_caches`);
     copy-on-write copies run per group (`KVCaches.copy_blocks(mapping, group)`). Chosen over one pool
     whose ids each hold a page of one group because the groups need not have equal page sizes or
     equal layer counts (one pool would need vLLM's trick of equal-sized groups sharing tensors), and
     the window group's need is bounded (its blocks per request), so a fixed split sizes it exactly;
     the C++ pools stay the single-table BlockManager unchanged, one per group.
  2. C++ (csrc/core/kv_cache_coordinator.*): one BlockManager per group, each with its own window, null
     block, free queue, prefix-cache index and watermark; a request has a block table in each (same
     length; handles identical, the groups moving in lockstep). Admission and growth are all or
     nothing over the groups (every group must have room above its watermark), so a step preempts
     until every group fits; copy-on-write pairs name their group (`SchedulerOutput.cow_copy_groups`).
  3. prefix cache: each group finds its hit (a window group from the right) at most the others' length,
     until they agree: the request's hit is the minimum over groups.
  4. SchedulerOutput carries one slot mapping and block table per group (`group_slot_mapping(g)`,
     `group_block_tables(g)`; group 0's are `slot_mapping` / `block_tables`), AttentionMetadata too
     (`group_slot_mappings`, `group_block_tables`, `for_group(g)`); the model runner wraps the backend
     in `KVGroupAttention` (one backend instance per group, each layer sent to its group's) and
     step-graph replays take every group's arrays as inputs. Kernels need nothing new: null entries
     lie before every query's window.
  Sizing (`determine_group_num_blocks`): `num_kv_blocks` gives every group that many blocks; else the
  budget buys N max-length requests (at most max_num_seqs), each window group gets N requests' worth of
  its bounded blocks (+ its null block) and the other groups share the rest.
  `free_sliding_blocks=False` (a pipeline stage; the draft model's own BlockManager) keeps the shared-id
  path, the window a mask. Groups with different block sizes are still refused (`check_one_block_table`).

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
    # a hybrid cache's window group: its block manager frees the blocks that left this window (0 = none)
    sliding_window: int = 0

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
    # hybrid cache: each group's own block count (its ids index only its layers' pages; group 0's = num_blocks);
    # () = every group shares the `num_blocks` ids
    group_num_blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        if not self.groups:
            raise ValueError("a KVCacheConfig needs at least one group")
        if self.group_num_blocks and (len(self.group_num_blocks) != len(self.groups)
                                      or self.group_num_blocks[0] != self.num_blocks
                                      or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                             for n in self.group_num_blocks)):
            raise ValueError(f"group_num_blocks must hold one integer >= 1 per group ({len(self.groups)}), the first "
                             f"equal to num_blocks ({self.num_blocks}); got {self.group_num_blocks!r}")

    @property
    def is_hybrid(self) -> bool:
        """Whether each group has its own block ids and block table (a mixed model freeing its window groups)."""
        return bool(self.group_num_blocks)

    def num_blocks_of(self, group: int) -> int:
        """Block ids of one group (every group's the same `num_blocks` unless hybrid)."""
        return self.group_num_blocks[group] if self.group_num_blocks else self.num_blocks

    def layer_groups(self) -> dict[int, int]:
        """Layer id -> its group's index (shared layers: their target's group)."""
        return {layer_id: g for g, group in enumerate(self.groups) for layer_id in group.layer_ids}

    @property
    def extra_groups(self) -> list[tuple[int, int]]:
        """(num_blocks, sliding_window) of groups 1.. of a hybrid cache, for the C++ scheduler; [] otherwise."""
        return [(n, g.sliding_window) for n, g in zip(self.group_num_blocks[1:], self.groups[1:])]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_block_tables(self) -> int:
        """Block tables a request holds: one per group of a hybrid cache, else one."""
        return len(self.groups) if self.is_hybrid else len({g.block_size for g in self.groups})

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def sliding_window(self) -> int:
        """The (group 0) block manager's window (see `block_manager_window`; a hybrid cache's: group 0's);
        0 = every block lives as long as its request."""
        if self.is_hybrid:
            return self.groups[0].sliding_window
        return block_manager_window(self.layer_specs) if self.free_sliding_blocks else 0

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.groups)

    @property
    def total_bytes(self) -> int:
        return sum(self.num_blocks_of(g) * group.page_size_bytes for g, group in enumerate(self.groups))

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


def group_kv_cache_specs(layer_specs: Mapping[int, KVCacheSpec],
                         split_windows: bool = False) -> tuple[KVCacheGroup, ...]:
    """Group layers by page shape, in order of their first layer; shared layers join their target's group.
    `split_windows`: sliding-window layers form groups of their own, one per window (a hybrid cache).

    Raises TypeError for a value that is not a spec, ValueError for bad layer ids or shared targets.
    """
    _check_layer_specs(layer_specs)

    def window(spec: KVCacheSpec) -> int:
        return spec.window_size if split_windows and type(spec) is SlidingWindowSpec else 0

    members: dict[tuple[AttentionPageSpec, int], list[int]] = {}
    shared: dict[tuple[AttentionPageSpec, int], list[int]] = {}
    for layer_id in sorted(layer_specs):
        spec = layer_specs[layer_id]
        if isinstance(spec, SharedKVSpec):
            target = layer_specs[spec.target_layer]
            key = (target.page_spec, window(target))
            shared.setdefault(key, []).append(layer_id)
        else:
            key = (spec.page_spec, window(spec))
        members.setdefault(key, []).append(layer_id)
    return tuple(
        KVCacheGroup(layer_ids=tuple(ids), spec=key[0], shared_layer_ids=tuple(shared.get(key, ())),
                     sliding_window=key[1])
        for key, ids in sorted(members.items(), key=lambda kv: kv[1][0])
    )


def is_mixed_window_model(layer_specs: Mapping[int, KVCacheSpec]) -> bool:
    """Some layers slide and some do not (or slide by other windows): one block table cannot free their blocks
    (`block_manager_window` is 0), a hybrid cache with a group per window can."""
    return block_manager_window(layer_specs) == 0 and any(type(s) is SlidingWindowSpec for s in layer_specs.values())


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
    """Raise ValueError when the groups have different block sizes (every block table, a hybrid cache's too,
    maps position p to table[p // block_size] with one block size)."""
    if not groups:
        raise ValueError("no KV-cache groups: the model has no attention layers")
    block_sizes = sorted({g.block_size for g in groups})
    if len(block_sizes) > 1:
        described = "; ".join(f"layers {list(g.layer_ids)}: {g.spec}" for g in groups)
        raise ValueError(
            f"this model's KV cache needs {len(block_sizes)} block tables per request (block sizes {block_sizes}), "
            f"but the block manager needs one block size for all of them; give every layer the same block_size. "
            f"Groups: {described}"
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


def determine_group_num_blocks(groups: Sequence[KVCacheGroup], device: torch.device, max_model_len: int,
                               max_num_seqs: int, kv_cache_memory_gb: float | None = None,
                               kv_cache_fraction: float = 0.9, num_blocks_override: int | None = None,
                               max_chunk_tokens: int | None = None) -> tuple[int, ...]:
    """A hybrid cache's block count per group. `num_blocks_override`: every group gets exactly that many.
    Else the budget first buys whole requests: N = how many max-length requests fit (at most max_num_seqs), a
    request costing in each group the blocks it holds at once there (a window group: its window plus a chunk).
    Each window group gets N requests' blocks (+ its null block); the groups without a window share the rest
    equally (capped at max_num_seqs max-length requests), so prompts shorter than the window are the case
    where a window group, not the memory, bounds concurrency.

    Raises ValueError with a suggested setting when one max-length request does not fit.
    """
    check_one_block_table(groups)
    block_size = groups[0].block_size
    chunk = max_model_len if max_chunk_tokens is None else min(max_chunk_tokens, max_model_len)
    per_seq = [max_blocks_per_request(block_size, max_model_len, g.sliding_window, chunk) for g in groups]
    reserved = [1 if g.sliding_window else 0 for g in groups]  # the null block
    if num_blocks_override is not None:
        counts = tuple(int(num_blocks_override) for _ in groups)
        source = "num_kv_blocks"
    else:
        budget, source = _memory_budget(device, kv_cache_memory_gb, kv_cache_fraction)
        request_bytes = sum(n * g.page_size_bytes for n, g in zip(per_seq, groups))
        fixed_bytes = sum(r * g.page_size_bytes for r, g in zip(reserved, groups))
        n_seqs = min(max_num_seqs, max(0, budget - fixed_bytes) // request_bytes)
        window_bytes = sum((n_seqs * n + r) * g.page_size_bytes
                           for n, r, g in zip(per_seq, reserved, groups) if g.sliding_window)
        full_page_bytes = sum(g.page_size_bytes for g in groups if not g.sliding_window)
        full_cap = max([n * max_num_seqs for n, g in zip(per_seq, groups) if not g.sliding_window], default=0)
        full_blocks = min(full_cap, (budget - window_bytes) // full_page_bytes) if full_page_bytes else 0
        counts = tuple(n_seqs * n + r if g.sliding_window else full_blocks for n, r, g in zip(per_seq, reserved, groups))
    for g, (n, need, r) in enumerate(zip(counts, per_seq, reserved)):
        if n < need + r:
            one_request = sum((p + q) * grp.page_size_bytes for p, q, grp in zip(per_seq, reserved, groups))
            raise ValueError(
                f"the KV cache ({source}: {n} blocks of {block_size} tokens in group {g}, layers "
                f"{list(groups[g].layer_ids)}) cannot hold one request of max_model_len={max_model_len} tokens "
                f"({need + r} blocks needed there). Set kv_cache_memory_gb >= {one_request / GiB:.3f} or lower "
                f"max_model_len.")
    max_concurrency = min((n - r) / p for n, p, r in zip(counts, per_seq, reserved))
    logger.info("KV cache (hybrid, %s): %s blocks x %d tokens per group (windows %s; %.3f GiB); max concurrency "
                "%.2fx requests of %d tokens", source, list(counts), block_size, [g.sliding_window for g in groups],
                sum(n * g.page_size_bytes for n, g in zip(counts, groups)) / GiB, max_concurrency, max_model_len)
    return counts


def make_kv_cache_config(layer_specs: Mapping[int, KVCacheSpec], device: torch.device, max_model_len: int,
                         max_num_seqs: int, kv_cache_memory_gb: float | None = None, kv_cache_fraction: float = 0.9,
                         num_blocks_override: int | None = None, max_chunk_tokens: int | None = None,
                         free_sliding_blocks: bool = True) -> KVCacheConfig:
    """Group the layers, refuse what the block manager cannot serve, size: the engine's one call.
    A mixed model (`is_mixed_window_model`) gets a hybrid cache: a group per window, each with its own block ids.
    `max_chunk_tokens`: the scheduler's longest step per request (sizing with a sliding window).
    `free_sliding_blocks`: False when `layer_specs` are not the whole model's (a pipeline stage)."""
    if free_sliding_blocks and is_mixed_window_model(layer_specs):
        groups = group_kv_cache_specs(layer_specs, split_windows=True)
        counts = determine_group_num_blocks(groups, device, max_model_len, max_num_seqs, kv_cache_memory_gb,
                                            kv_cache_fraction, num_blocks_override, max_chunk_tokens)
        return KVCacheConfig(num_blocks=counts[0], groups=groups, layer_specs=dict(layer_specs),
                             free_sliding_blocks=True, group_num_blocks=counts)
    groups = group_kv_cache_specs(layer_specs)
    config = KVCacheConfig(num_blocks=1, groups=groups, layer_specs=dict(layer_specs),
                           free_sliding_blocks=free_sliding_blocks)
    num_blocks = determine_num_blocks(groups, device, max_model_len, max_num_seqs, kv_cache_memory_gb,
                                      kv_cache_fraction, num_blocks_override, config.sliding_window, max_chunk_tokens)
    return replace(config, num_blocks=num_blocks)
