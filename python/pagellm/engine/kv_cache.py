"""Sizing and allocating the paged KV cache.

Per layer: key_cache and value_cache of shape [num_blocks, num_kv_heads, block_size, head_dim].
The budget is `kv_cache_memory_gb` when given, else `kv_cache_fraction` of the memory still free
after the weights were loaded (CUDA: torch.cuda.mem_get_info; CPU: MemAvailable in /proc/meminfo).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagellm.logger import init_logger

logger = init_logger(__name__)
GiB = 1 << 30
CPU_DEFAULT_MAX_GB = 4


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elt = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * elt


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


def determine_num_blocks(spec: KVCacheSpec, device: torch.device, max_model_len: int, max_num_seqs: int,
                         kv_cache_memory_gb: float | None = None, kv_cache_fraction: float = 0.9,
                         num_blocks_override: int | None = None) -> int:
    """Blocks that fit the budget (capped at what max_num_seqs max-length requests can use).

    Raises ValueError with a suggested setting when one max-length request does not fit.
    """
    per_block = spec.bytes_per_block
    blocks_per_seq = math.ceil(max_model_len / spec.block_size)
    if num_blocks_override is not None:
        num_blocks = int(num_blocks_override)
        source = "num_kv_blocks"
    else:
        if kv_cache_memory_gb is not None:
            budget = int(kv_cache_memory_gb * GiB)
            source = f"kv_cache_memory_gb={kv_cache_memory_gb}"
        else:
            free = available_memory_bytes(device)
            budget = int(free * kv_cache_fraction)
            source = f"kv_cache_fraction={kv_cache_fraction} of {free / GiB:.2f} GiB free"
            if torch.device(device).type == "cpu" and budget > CPU_DEFAULT_MAX_GB * GiB:
                # host memory is shared with everything else: cap unless asked explicitly
                budget = CPU_DEFAULT_MAX_GB * GiB
                source += f", capped at {CPU_DEFAULT_MAX_GB} GiB on CPU (set kv_cache_memory_gb for more)"
        num_blocks = budget // per_block
        # never more than every sequence slot at full length can use (+1 for the null block)
        num_blocks = min(num_blocks, blocks_per_seq * max_num_seqs + 1)
    if num_blocks < blocks_per_seq + 1:
        need_gb = (blocks_per_seq + 1) * per_block / GiB
        fit_len = max(0, (num_blocks - 1) * spec.block_size)
        raise ValueError(
            f"the KV cache ({source}: {num_blocks} blocks of {spec.block_size} tokens) cannot hold one "
            f"request of max_model_len={max_model_len} tokens ({blocks_per_seq + 1} blocks needed). "
            f"Set kv_cache_memory_gb >= {need_gb:.3f} or max_model_len <= {fit_len}."
        )
    max_concurrency = (num_blocks * spec.block_size) / max_model_len
    logger.info(
        "KV cache: %d blocks x %d tokens (%.3f GiB, %s); max concurrency %.2fx requests of %d tokens",
        num_blocks, spec.block_size, num_blocks * per_block / GiB, source, max_concurrency, max_model_len,
    )
    return num_blocks


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
    # zeros, not empty: a backend that multiplies masked-out slots by 0 must not meet NaN garbage
    return [
        (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
        for _ in range(spec.num_layers)
    ]
