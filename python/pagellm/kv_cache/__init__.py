"""The paged KV cache: per-layer specs (spec.py), groups (groups.py), sizing (sizing.py), typed caches (cache.py).

    specs = model.kv_cache_specs(block_size, dtype)                # layer id -> spec
    config = make_kv_cache_config(specs, device, max_model_len, max_num_seqs, kv_cache_memory_gb=1)
    kv_caches = allocate_kv_caches(config, device)                 # kv_caches[layer_id] -> PagedKVCache

A mixed sliding / full model gets a hybrid cache (config.is_hybrid: a group per window, each with its own
block ids and block table); see groups.py.
"""

from pagellm.kv_cache.cache import KVCaches, LatentKVCache, LayerKVCache, PagedKVCache, allocate_kv_caches
from pagellm.kv_cache.groups import (
    KVCacheConfig,
    KVCacheGroup,
    bytes_per_block,
    check_one_block_table,
    count_layer_kinds,
    group_kv_cache_specs,
    is_mixed_window_model,
    kv_bytes_per_token,
)
from pagellm.kv_cache.sizing import (
    available_memory_bytes,
    determine_group_num_blocks,
    determine_num_blocks,
    make_kv_cache_config,
)
from pagellm.kv_cache.spec import (
    FLOAT_CACHE_DTYPES,
    QUANTIZED_CACHE_DTYPES,
    SCALE_DTYPE,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SharedKVSpec,
    SlidingWindowSpec,
)

__all__ = [
    "FLOAT_CACHE_DTYPES",
    "QUANTIZED_CACHE_DTYPES",
    "SCALE_DTYPE",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheSpec",
    "KVCaches",
    "LatentKVCache",
    "LayerKVCache",
    "MLAAttentionSpec",
    "PagedKVCache",
    "SharedKVSpec",
    "SlidingWindowSpec",
    "allocate_kv_caches",
    "available_memory_bytes",
    "bytes_per_block",
    "check_one_block_table",
    "count_layer_kinds",
    "determine_group_num_blocks",
    "determine_num_blocks",
    "group_kv_cache_specs",
    "is_mixed_window_model",
    "kv_bytes_per_token",
    "make_kv_cache_config",
]
