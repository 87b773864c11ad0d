"""What a model's forward needs besides tokens and positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.attention.base import BaseAttentionBackend


@dataclass
class ForwardContext:
    attn_backend: BaseAttentionBackend                     # already `plan()`ned for this step
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]     # per layer (key_cache, value_cache)
    # decode-only step on a backend whose decode is torch.ops.pagellm.paged_attention_decode: layers
    # that can run as one torch.ops.pagellm.fused_decode_layer call do (see ModelRunner.use_fused_decode)
    fused_decode: bool = False
