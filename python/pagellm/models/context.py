"""What a model's forward needs besides tokens and positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.attention.base import BaseAttentionBackend


@dataclass
class ForwardContext:
    attn_backend: BaseAttentionBackend                     # already `plan()`ned for this step
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]     # per layer (key_cache, value_cache)
