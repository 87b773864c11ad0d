"""The attention of a step whose speculative rows carry candidate trees (engine/tree_step.py).

`TreeVerifyAttention` wraps the step's backend for that one step: K/V are written as usual, then every row
attends through `paged_tree_attention` with the step's tree mask (a decode row is a one-node tree, a prefill
chunk a chain, a spec row its draft tree). Float KV caches and full-attention layers only (`tree_layer_refusal`):
a tree proposer refuses such a model at start-up (`tree_verify_refusal`, run on each worker), and a tree verify
step that meets one anyway raises ValueError (the step's requests fail, the engine goes on). Layers reading
another layer's cache (cross-layer KV sharing) are fine: they write nothing and read the shared float cache.
"""

from __future__ import annotations

import torch

from pagellm import ops
from pagellm.attention.base import AttentionLayerSpec, AttentionMetadata, BaseAttentionBackend
from pagellm.kv_cache import PagedKVCache
from pagellm.kv_cache.spec import SlidingWindowSpec
from pagellm.ops import reference


def tree_layer_refusal(kv_cache, window_size: int = -1) -> str | None:
    """Why tree verification cannot run a layer with this cache (None: it can)."""
    if not isinstance(kv_cache, PagedKVCache):
        return "a latent (MLA) KV cache"
    if kv_cache.k_scale is not None:
        return f"a quantized KV cache ({kv_cache.spec.dtype}; tree verification reads float caches)"
    if window_size != -1 or isinstance(kv_cache.spec, SlidingWindowSpec):
        return "sliding-window attention"
    return None


def tree_verify_refusal(worker) -> str | None:
    """On a worker (collective_rpc): why its model cannot run tree verification steps, or None."""
    caches = worker.runner.kv_caches
    for layer_id in caches.layer_ids:
        reason = tree_layer_refusal(caches[layer_id])
        if reason is not None:
            return f"layer {layer_id} has {reason}"
    return None


def check_tree_verification(executor, what: str, fallback: str) -> None:
    """ValueError, at start-up, when the target's workers cannot run tree verification steps (a quantized KV
    cache, sliding-window or MLA layers): `what` names the trees ("Medusa trees"), `fallback` how to verify chain
    drafts instead ("drop 'tree'"). No executor (a proposer built by hand): nothing to check."""
    if executor is None:
        return
    for reason in executor.collective_rpc(tree_verify_refusal):
        if reason is not None:
            raise ValueError(f"speculative_config: {what} are verified with paged_tree_attention, which cannot run "
                             f"this model ({reason}); {fallback} to verify chain drafts instead")


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
        reason = tree_layer_refusal(kv_cache, layer.window_size)
        if reason is not None:
            raise ValueError(f"tree verification cannot run layer {layer.layer_idx}: it has {reason}")
        n = md.num_tokens
        out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)  # padded tokens stay zero
        if key is not None:  # None: a layer reading another layer's cache, written already
            _write_op()(kv_cache.key_cache, kv_cache.value_cache, key[:n], value[:n], md.slot_mapping)
        _tree_op()(out[:n], query[:n], kv_cache.key_cache, kv_cache.value_cache, md.block_tables,
                   md.query_start_loc, md.seq_lens, self.tree_mask, float(layer.scale), float(layer.softcap))
        return out
