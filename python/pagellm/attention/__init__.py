"""Attention backends: `torch` (reference), `cpu` (C++ ops), `cuda`; see registry.py to add your own."""

from pagellm.attention.base import AttentionLayerSpec, AttentionMetadata, BaseAttentionBackend
from pagellm.attention.registry import (
    get_attention_backend_cls,
    list_attention_backends,
    register_attention_backend,
    select_attention_backend,
)

# Built-in backends register themselves on import.
from pagellm.attention import torch_backend as _torch_backend  # noqa: E402,F401
from pagellm.attention import cpu_backend as _cpu_backend  # noqa: E402,F401
from pagellm.attention import cuda_backend as _cuda_backend  # noqa: E402,F401

__all__ = [
    "AttentionLayerSpec",
    "AttentionMetadata",
    "BaseAttentionBackend",
    "get_attention_backend_cls",
    "list_attention_backends",
    "register_attention_backend",
    "select_attention_backend",
]
