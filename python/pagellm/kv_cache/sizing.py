"""Sizing the paged KV cache from memory, and `make_kv_cache_config`, the engine's one call (group, check, size).

Budget (`determine_num_blocks`): `kv_cache_memory_gb` when given, else `kv_cache_fraction` of the
memory still free after the weights were loaded (CUDA: torch.cuda.mem_get_info; CPU: MemAvailable in
/proc/meminfo, capped at CPU_DEFAULT_MAX_GB), or exactly `num_kv_blocks` when set.

A hybrid cache (`determine_group_num_blocks`; see groups.py): `num_kv_blocks` gives every group that many
blocks; else the budget buys N max-length requests (at most max_num_seqs), each window group gets N
requests' worth of its bounded blocks (+ its null block) and the other groups share the rest.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping, Sequence

import torch

from pagellm.kv_cache.groups import (
    KVCacheConfig,
    KVCacheGroup,
    bytes_per_block,
    check_one_block_table,
    group_kv_cache_specs,
    is_mixed_window_model,
)
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm.logger import init_logger

logger = init_logger(__name__)
GiB = 1 << 30
CPU_DEFAULT_MAX_GB = 4


def max_blocks_per_request(block_size: int, max_model_len: int, window: int, max_chunk_tokens: int) -> int:
    """Most blocks one request holds at once: all of a max-length request's without a window, else those a
    window plus the longest chunk can span (the C++ BlockManager::max_live_blocks)."""
    all_blocks = math.ceil(max_model_len / block_size)
    if window == 0:
        return all_blocks
    return min(all_blocks, math.ceil((window - 1 + max_chunk_tokens) / block_size) + 1)


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
