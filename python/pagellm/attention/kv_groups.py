"""Attention over a hybrid KV cache: each layer reads its own group's block table and slot mapping.

A hybrid cache (pagellm.kv_cache.groups, a mixed model such as Gemma 2/3) gives each group of layers its own
block ids, so one step carries one block table and slot mapping per group (`AttentionMetadata.for_group`).
`KVGroupAttention` holds one instance of the step's backend class per group, plans each with its group's
metadata, and sends every layer to the instance of its group. Kernels need nothing new: a window group's
table holds the null block before each query's window, which the window mask skips.
"""

from __future__ import annotations

from typing import Mapping

import torch

from pagellm.attention.base import AttentionLayerSpec, AttentionMetadata, BaseAttentionBackend


class KVGroupAttention(BaseAttentionBackend):
    """`inner` serves group 0; a fresh instance of its class serves each other group.

    layer_groups: layer id -> group index, every attention layer (shared layers: their target's group).
    """

    def __init__(self, inner: BaseAttentionBackend, layer_groups: Mapping[int, int]) -> None:
        super().__init__(inner.device)
        num_groups = max(layer_groups.values(), default=0) + 1
        if num_groups < 2:
            raise ValueError("KVGroupAttention needs a hybrid KV cache (two groups or more)")
        self.name = inner.name
        self.inner = inner
        self.backends = [inner] + [type(inner)(inner.device) for _ in range(num_groups - 1)]
        self.layer_groups = dict(layer_groups)

    @property
    def step_graph_safe(self) -> bool:
        return self.inner.step_graph_safe

    def plan(self, metadata: AttentionMetadata) -> None:
        super().plan(metadata)
        if metadata.num_kv_cache_groups != len(self.backends):
            raise ValueError(f"the step's metadata has {metadata.num_kv_cache_groups} KV-cache groups, the cache "
                             f"{len(self.backends)}")
        for g, backend in enumerate(self.backends):
            backend.plan(metadata.for_group(g))

    def forward(self, layer: AttentionLayerSpec, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache) -> torch.Tensor:
        group = self.layer_groups.get(layer.layer_idx)
        if group is None:
            raise KeyError(f"layer {layer.layer_idx} belongs to no KV-cache group; layers: {sorted(self.layer_groups)}")
        return self.backends[group].forward(layer, query, key, value, kv_cache)
