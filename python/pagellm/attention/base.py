"""The attention-backend contract: a plan step once per batch, a forward step once per layer.

A backend owns how K/V are written into the paged cache and how attention reads it. Each layer
hands it that layer's `PagedKVCache` (pagellm.kv_cache); the layout is fixed for every backend and
device (see docs/kv_cache_layout.md):

    kv_cache.key_cache, kv_cache.value_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    kv_cache.k_scale, kv_cache.v_scale:       [num_blocks, num_kv_heads, block_size] float32 (one per row),
                                              quantized cache dtypes (int8, fp8_e4m3) only

The model runner builds one `AttentionMetadata` per step from the scheduler output, calls
`backend.plan(metadata)` once, then every attention layer calls `backend.forward(...)`.
Requests are ordered decodes first: the first `num_decode_reqs` requests have exactly one query
token each (tokens `[0, num_decode_tokens)`), the rest are prefill chunks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagellm.kv_cache import PagedKVCache


@dataclass
class AttentionMetadata:
    """One step's batch, as tensors on the compute device.

    slot_mapping:     int64 [num_tokens]      cache slot (block * block_size + offset) of each new token; -1 = skip
    block_tables:     int32 [num_reqs, max_blocks_per_req]  physical block ids, padded with 0
    seq_lens:         int32 [num_reqs]        context length after this step (cached + new tokens)
    query_start_loc:  int32 [num_reqs + 1]    prefix sums of query lengths
    group_slot_mappings, group_block_tables: a hybrid KV cache's groups 1.. (each with its own block ids), the
        shapes of slot_mapping / block_tables (group 0's); () with one group. `for_group(g)` is group g's view.
    """

    num_reqs: int
    num_tokens: int
    num_decode_reqs: int
    max_query_len: int
    max_seq_len: int
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    group_slot_mappings: tuple[torch.Tensor, ...] = ()
    group_block_tables: tuple[torch.Tensor, ...] = ()

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_reqs

    @property
    def num_kv_cache_groups(self) -> int:
        return 1 + len(self.group_slot_mappings)

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata one group's layers read: its slot mapping and block tables, no other group's."""
        if group == 0:
            return self if not self.group_slot_mappings else replace(self, group_slot_mappings=(), group_block_tables=())
        return replace(self, slot_mapping=self.group_slot_mappings[group - 1],
                       block_tables=self.group_block_tables[group - 1], group_slot_mappings=(), group_block_tables=())


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Static per-layer attention parameters.

    window_size: number of keys a query sees, itself included (Mistral's sliding_window); -1 = full.
    softcap: logits soft-capping, softcap * tanh(s / softcap); 0 = off.
    kv_source_layer: -1 = the layer writes its own K/V; else the layer (an earlier one) whose cache it reads
        (cross-layer KV sharing): it writes nothing and the backend gets key = value = None.
    """

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window_size: int = -1
    softcap: float = 0.0
    kv_source_layer: int = -1

    @property
    def writes_kv(self) -> bool:
        return self.kv_source_layer < 0


class BaseAttentionBackend(ABC):
    """Interface every attention backend implements. Subclasses set `name`."""

    name: str = "base"
    # True when plan() + forward() are replayable as a step graph (pagellm.step_graph): given the
    # metadata's tensors and its num_reqs / num_tokens / num_decode_reqs, they make the same op calls
    # every step and never read tensor data into Python (no .tolist(), .item(), max_seq_len).
    step_graph_safe: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.metadata: AttentionMetadata | None = None

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        """Whether the backend can run on `device`; the reason when it cannot."""
        return True, ""

    def plan(self, metadata: AttentionMetadata) -> None:
        """Prepare for one step (once per batch, before any layer). Default: remember the metadata."""
        self.metadata = metadata

    def rope_and_write(self, layer: AttentionLayerSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: PagedKVCache, rotary_emb, positions: torch.Tensor) -> bool:
        """Rotate query and key in place by `rotary_emb` (a RotaryEmbedding: `cos_sin_cache`, `head_size`,
        `is_neox_style`) at `positions` and write key / value into `kv_cache`, both in one step, when this backend
        can; forward() is then called with key = value = None. False (the default): the caller rotates and
        forward() writes."""
        return False

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """Write this step's K/V into `kv_cache`, then attend.

        query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads, head_dim], or both
        None for a layer that shares another layer's cache (`layer.writes_kv` False): nothing is written and
        attention reads what the target layer wrote earlier in this step.
        kv_cache: this layer's PagedKVCache (a shared layer gets its target layer's object).
        Returns [num_tokens, num_heads, head_dim]: causal attention of each token over its request's
        cached context plus the chunk's earlier tokens (and itself).
        A backend that cannot run on `kv_cache.spec.dtype` (e.g. a quantized cache) raises
        NotImplementedError naming it; the built-in ones run on every cache dtype.
        """
