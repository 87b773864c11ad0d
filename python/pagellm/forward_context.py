"""What a model's forward needs besides tokens and positions (shared by the runner and the models)."""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.attention.base import BaseAttentionBackend
from pagellm.kv_cache import KVCaches


@dataclass
class ForwardContext:
    attn_backend: BaseAttentionBackend  # already `plan()`ned for this step
    kv_caches: KVCaches                 # kv_caches[layer_idx] -> that layer's cache object
