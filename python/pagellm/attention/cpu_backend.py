"""The `cpu` attention backend: the C++ ops (torch.ops.pagellm.*) on CPU tensors.

Decodes (the first num_decode_reqs requests, one token each) go through paged_attention_decode
(flash-decoding), the remaining prefill chunks through paged_attention_prefill; both write into one
preallocated output.
"""

from __future__ import annotations

import torch

from pagellm import ops
from pagellm.attention.registry import register_attention_backend
from pagellm.attention.torch_backend import PagedBackendBase


@register_attention_backend("cpu")
class CpuAttentionBackend(PagedBackendBase):
    """C++ paged attention on CPU (AVX-512 when built for it)."""

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        if torch.device(device).type != "cpu":
            return False, f"the cpu backend runs on CPU tensors only, not {torch.device(device)}"
        return ops.ops_available()

    _write = staticmethod(ops.reshape_and_cache)
    _decode = staticmethod(ops.paged_attention_decode)
    _prefill = staticmethod(ops.paged_attention_prefill)
