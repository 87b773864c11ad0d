"""A draft whose KV cache has the target's layout (a self-draft of every layer, e.g. the target's own Q4_1 file) takes
the KV of a sequence's committed tokens from the target's cache instead of computing it: one block copy per layer in
place of a second prefill. Session 13 measured that catch-up at 279 ms CPU per 360-token prompt (23 plain steps),
which held the own-Q4_1 draft at 0.82x no speculation on 48-token answers.

The copied rows are the target's, not what the draft would have computed, so drafts may differ; outputs cannot
(verification decides what is kept). Used only when every layer's cache matches in shape and dtype (float caches,
one KV group) and the target's worker and its block tables live in this process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

if TYPE_CHECKING:
    from pagellm.kv_cache import KVCaches

# a catch-up of fewer committed tokens than this is computed by the draft (a copy would not save a forward)
MIN_REUSED_TOKENS = 16


def layout_mismatch(draft: KVCaches, target: KVCaches) -> str | None:
    """Why the draft cannot read the target's KV rows as its own (None: it can)."""
    from pagellm.kv_cache.cache import PagedKVCache  # noqa: PLC0415 - kv_cache is imported lazily by spec_decode

    if draft.num_groups != 1 or target.num_groups != 1:
        return "a hybrid KV cache (several block groups)"
    if draft.layer_ids != target.layer_ids:
        return f"the draft caches layers {draft.layer_ids}, the target {target.layer_ids}"
    for layer in draft.layer_ids:
        d, t = draft[layer], target[layer]
        if not (isinstance(d, PagedKVCache) and isinstance(t, PagedKVCache)) or d.is_quantized or t.is_quantized:
            return f"layer {layer}: not a float paged cache"
        if d.key_cache.shape[1:] != t.key_cache.shape[1:] or d.key_cache.dtype != t.key_cache.dtype:
            return f"layer {layer}: block shape {tuple(d.key_cache.shape[1:])} vs {tuple(t.key_cache.shape[1:])}"
    return None


class TargetKV:
    """The target's KV cache and its per-sequence block tables (`block_table(seq_id) -> block ids`)."""

    def __init__(self, caches: KVCaches, block_table: Callable[[str], Sequence[int]], block_size: int) -> None:
        self.caches = caches
        self.block_table = block_table
        self.block_size = block_size

    def copy_into(self, draft: KVCaches, seq_id: str, draft_blocks: Sequence[int], start: int, end: int) -> bool:
        """Copy the KV of positions [start, end) of `seq_id` (start a block boundary; the target holds them) into the
        draft's blocks, whole blocks at a time (the last block's rows past `end` are garbage the draft overwrites
        when it computes them). False (nothing copied) when the target's table does not cover them."""
        first, last = start // self.block_size, -(-end // self.block_size)
        src_ids = list(self.block_table(seq_id))
        if start % self.block_size or len(src_ids) < last or len(draft_blocks) < last or first >= last:
            return False
        src = torch.tensor(src_ids[first:last], dtype=torch.int64)
        dst = torch.tensor(list(draft_blocks[first:last]), dtype=torch.int64)
        for layer in draft.layer_ids:
            d, t = draft[layer], self.caches[layer]
            d.key_cache.index_copy_(0, dst, t.key_cache.index_select(0, src))
            d.value_cache.index_copy_(0, dst, t.value_cache.index_select(0, src))
        return True


def target_kv_for(draft: KVCaches, executor, block_table: Callable[[str], Sequence[int]] | None,
                  block_size: int) -> TargetKV | None:
    """A TargetKV when the target's single worker runs in this process and its cache layout is the draft's."""
    from pagellm.kv_cache import KVCaches  # noqa: PLC0415

    worker = getattr(executor, "driver_worker", None)
    caches = getattr(worker, "kv_caches", None)
    if block_table is None or len(getattr(executor, "workers", ())) != 1 or not isinstance(caches, KVCaches):
        return None
    return None if layout_mismatch(draft, caches) is not None else TargetKV(caches, block_table, block_size)
