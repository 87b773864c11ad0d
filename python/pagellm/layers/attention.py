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

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, ctx,
                rope: tuple[nn.Module, torch.Tensor] | None = None) -> torch.Tensor:
        """rope: (rotary_emb, positions) to rotate q and k by (in place) before attention; the backend may do it
        together with its K/V write (`BaseAttentionBackend.rope_and_write`: one kernel on CUDA)."""
        s = self.spec
        T = q.shape[0]
        # views (the rows may be strided slices of a merged qkv output; the heads inside a row are not)
        query = q.view(T, s.num_heads, s.head_dim)
        backend, kv_cache = ctx.attn_backend, ctx.kv_caches[s.layer_idx]
        if s.writes_kv:
            key, value = k.view(T, s.num_kv_heads, s.head_dim), v.view(T, s.num_kv_heads, s.head_dim)
            if rope is not None:
                if backend.rope_and_write(s, query, key, value, kv_cache, *rope):
                    key = value = None  # rotated and written: attention reads them from the cache
                else:
                    rope[0](rope[1], q, k)
        else:
            key = value = None
            if rope is not None:
                raise ValueError(f"layer {s.layer_idx} shares another layer's KV cache: rotate its query itself")
        out = backend.forward(s, query, key, value, kv_cache)
        return out.view(T, s.num_heads * s.head_dim)

    def extra_repr(self) -> str:
        return repr(self.spec)
