"""The `torch` attention backend: pure-torch reference write + attention (pagellm.ops.reference).

Always available on every device; slow (a Python loop over requests). The yardstick for the others.
"""

from __future__ import annotations

import torch

from pagellm.attention.base import AttentionLayerSpec, AttentionMetadata, BaseAttentionBackend
from pagellm.attention.registry import register_attention_backend
from pagellm.kv_cache import PagedKVCache
from pagellm.ops import reference


class _SplitBatch:
    """Decode/prefill views of one step's metadata, computed once in plan()."""

    def __init__(self, md: AttentionMetadata) -> None:
        nd = md.num_decode_reqs
        self.num_decode = nd
        self.num_tokens = md.num_tokens
        self.decode_block_tables = md.block_tables[:nd]
        self.decode_seq_lens = md.seq_lens[:nd]
        self.has_prefill = md.num_reqs > nd
        self.prefill_block_tables = md.block_tables[nd : md.num_reqs]
        self.prefill_seq_lens = md.seq_lens[nd : md.num_reqs]
        # Decodes are one token each, so the prefill tokens start at token nd.
        self.prefill_query_start_loc = (md.query_start_loc[nd : md.num_reqs + 1] - nd).to(torch.int32)


class PagedBackendBase(BaseAttentionBackend):
    """Shared forward(): write K/V, decodes through `_decode`, prefill chunks through `_prefill`.

    A quantized cache (int8 / fp8 values with per-row scales) goes through the `*_quantized` bindings,
    whose arguments are the float ones with (key_cache, value_cache) widened to (key_cache, value_cache,
    k_scale, v_scale): one code path, the cache's tensors splatted where the caches go.
    """

    def plan(self, metadata: AttentionMetadata) -> None:
        super().plan(metadata)
        self._split = _SplitBatch(metadata)

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        if self.metadata is None:
            raise RuntimeError(f"{type(self).__name__}.forward called before plan()")
        if not isinstance(kv_cache, PagedKVCache):
            raise TypeError(f"the {self.name!r} attention backend takes a PagedKVCache, got {type(kv_cache).__name__}")
        if kv_cache.k_scale is None:
            caches = (kv_cache.key_cache, kv_cache.value_cache)
            write, decode, prefill = self._write, self._decode, self._prefill
        else:
            caches = (kv_cache.key_cache, kv_cache.value_cache, kv_cache.k_scale, kv_cache.v_scale)
            write, decode, prefill = self._write_quantized, self._decode_quantized, self._prefill_quantized
        md, sp = self.metadata, self._split
        n = sp.num_tokens
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        o = out
        if query.shape[0] > n:
            query, o = query[:n], out[:n]
            out[n:].zero_()  # padded tokens
        if key is not None:  # None: a layer sharing another layer's cache, which wrote it already
            if key.shape[0] > n:
                key, value = key[:n], value[:n]
            write(*caches, key, value, md.slot_mapping)
        args = (layer.scale, layer.window_size, layer.softcap)
        nd = sp.num_decode
        if nd == n:  # decodes only, the common step: no slicing
            decode(o, query, *caches, sp.decode_block_tables, sp.decode_seq_lens, *args)
            return out
        if nd:
            decode(o[:nd], query[:nd], *caches, sp.decode_block_tables, sp.decode_seq_lens, *args)
        if sp.has_prefill:
            prefill(
                o[nd:], query[nd:], *caches, sp.prefill_block_tables,
                sp.prefill_query_start_loc, sp.prefill_seq_lens, *args,
            )  # fmt: skip
        return out

    # Subclasses bind these to their ops (same signatures as pagellm.ops).
    _write = staticmethod(reference.reshape_and_cache)
    _decode = staticmethod(reference.paged_attention_decode)
    _prefill = staticmethod(reference.paged_attention_prefill)
    _write_quantized = staticmethod(reference.reshape_and_cache_quantized)
    _decode_quantized = staticmethod(reference.paged_attention_decode_quantized)
    _prefill_quantized = staticmethod(reference.paged_attention_prefill_quantized)


@register_attention_backend("torch")
class TorchAttentionBackend(PagedBackendBase):
    """Reference backend: pure torch, any device."""
