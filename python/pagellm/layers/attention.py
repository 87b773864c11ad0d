"""The attention layer: reshapes q/k/v to heads and hands them to the step's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.base import AttentionLayerSpec


class Attention(nn.Module):
    """Holds one layer's static `AttentionLayerSpec`; the backend and this layer's KV cache
    (`ctx.kv_caches[layer_idx]`, a PagedKVCache) come from `ctx`.

    forward(q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*D], ctx) -> [T, Hq*D]
    kv_source_layer >= 0 (cross-layer KV sharing): k and v are None; attention reads that earlier layer's cache.
    """

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 window_size: int = -1, softcap: float = 0.0, kv_source_layer: int = -1) -> None:
        super().__init__()
        if kv_source_layer >= layer_idx:
            raise ValueError(f"layer {layer_idx}: kv_source_layer must be an earlier layer or -1, "
                             f"got {kv_source_layer}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.spec = AttentionLayerSpec(
            layer_idx=layer_idx,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scale=float(head_dim**-0.5 if scale is None else scale),
            window_size=int(window_size) if window_size and window_size > 0 else -1,
            softcap=float(softcap or 0.0),
            kv_source_layer=int(kv_source_layer) if kv_source_layer >= 0 else -1,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, ctx) -> torch.Tensor:
        s = self.spec
        T = q.shape[0]
        # views (the rows may be strided slices of a merged qkv output; the heads inside a row are not)
        query = q.view(T, s.num_heads, s.head_dim)
        if s.writes_kv:
            key, value = k.view(T, s.num_kv_heads, s.head_dim), v.view(T, s.num_kv_heads, s.head_dim)
        else:
            key = value = None
        out = ctx.attn_backend.forward(s, query, key, value, ctx.kv_caches[s.layer_idx])
        return out.view(T, s.num_heads * s.head_dim)

    def extra_repr(self) -> str:
        return repr(self.spec)
