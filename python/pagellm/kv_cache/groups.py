"""Grouping the layers' KV-cache specs (sizing the cache from memory: kv_cache/sizing.py).

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
  Sizing: `sizing.determine_group_num_blocks`.
  `free_sliding_blocks=False` (a pipeline stage; the draft model's own BlockManager) keeps the shared-id
  path, the window a mask. Groups with different block sizes are still refused (`check_one_block_table`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from pagellm.kv_cache.spec import (
    AttentionPageSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SharedKVSpec,
    SlidingWindowSpec,
)


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
