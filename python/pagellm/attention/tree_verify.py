"""The attention of a step whose speculative rows carry candidate trees (engine/tree_step.py).

`TreeVerifyAttention` wraps the step's backend for that one step: K/V are written as usual, then every row
attends through `paged_tree_attention` with the step's tree mask (a decode row is a one-node tree, a prefill
chunk a chain, a spec row its draft tree). Float KV caches and full-attention layers only: a tree verify step
on a quantized cache or a sliding-window layer raises ValueError (the step's requests fail, the engine goes on).
"""

from __future__ import annotations

import torch

from pagellm import ops
from pagellm.attention.base import AttentionLayerSpec, AttentionMetadata, BaseAttentionBackend
from pagellm.ops import reference


def _tree_op():
    return torch.ops.pagellm.paged_tree_attention.default if ops.ops_available()[0] else reference.paged_tree_attention


def _write_op():
    return torch.ops.pagellm.reshape_and_cache.default if ops.ops_available()[0] else reference.reshape_and_cache


class TreeVerifyAttention(BaseAttentionBackend):
    """One step's attention with tree masks. tree_mask: bool [num_tokens, max query length] (row t, column j:
    token j of t's row is visible to t); every committed position is visible to every token."""

    name = "tree_verify"

    def __init__(self, inner: BaseAttentionBackend, tree_mask: torch.Tensor) -> None:
        super().__init__(inner.device)
        self.inner = inner
        self.tree_mask = tree_mask

    @property
    def step_graph_safe(self) -> bool:
        return False

    def plan(self, metadata: AttentionMetadata) -> None:
        super().plan(metadata)
        if self.tree_mask.shape[0] != metadata.num_tokens:
            raise ValueError(f"tree_mask has {self.tree_mask.shape[0]} rows, the step {metadata.num_tokens} tokens")

    def forward(self, layer: AttentionLayerSpec, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache) -> torch.Tensor:
        md = self.metadata
        if md is None:
            raise RuntimeError("TreeVerifyAttention.forward called before plan()")
        if getattr(kv_cache, "k_scale", None) is not None or not hasattr(kv_cache, "key_cache"):
            raise ValueError("tree verification needs a float paged KV cache (not a quantized or latent one)")
        if layer.window_size != -1:
            raise ValueError("tree verification does not support sliding-window attention layers")
        n = md.num_tokens
        out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)  # padded tokens stay zero
        if key is not None:  # None: a layer reading another layer's cache, written already
            _write_op()(kv_cache.key_cache, kv_cache.value_cache, key[:n], value[:n], md.slot_mapping)
        _tree_op()(out[:n], query[:n], kv_cache.key_cache, kv_cache.value_cache, md.block_tables,
                   md.query_start_loc, md.seq_lens, self.tree_mask, float(layer.scale), float(layer.softcap))
        return out
