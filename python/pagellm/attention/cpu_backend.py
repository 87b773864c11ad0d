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
    """C++ paged attention on CPU (AVX-512 when built for it); float, int8 and fp8 KV caches (PagedBackendBase.forward)."""

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        if torch.device(device).type != "cpu":
            return False, f"the cpu backend runs on CPU tensors only, not {torch.device(device)}"
        return ops.ops_available()

    # The registered overloads, not the validating pagellm.ops wrappers: forward() runs once per layer
    # per step, and the C++ glue checks every argument anyway.
    if ops.ops_available()[0]:
        _write = staticmethod(torch.ops.pagellm.reshape_and_cache.default)
        _decode = staticmethod(torch.ops.pagellm.paged_attention_decode.default)
        _prefill = staticmethod(torch.ops.pagellm.paged_attention_prefill.default)
        _write_quantized = staticmethod(torch.ops.pagellm.reshape_and_cache_quantized.default)
        _decode_quantized = staticmethod(torch.ops.pagellm.paged_attention_decode_quantized.default)
        _prefill_quantized = staticmethod(torch.ops.pagellm.paged_attention_prefill_quantized.default)

    @property
    def step_graph_safe(self) -> bool:
        """The registered C++ ops only read the metadata tensors; a subclass that overrides plan() or
        forward() or binds other kernels (a Python reference, say) may read data, so it must say so itself."""
        cls = type(self)
        op = torch.ops.pagellm if ops.ops_available()[0] else None
        return bool(op is not None and cls.forward is PagedBackendBase.forward
                    and cls.plan is PagedBackendBase.plan
                    and cls._write is op.reshape_and_cache.default
                    and cls._decode is op.paged_attention_decode.default
                    and cls._prefill is op.paged_attention_prefill.default
                    and cls._write_quantized is op.reshape_and_cache_quantized.default
                    and cls._decode_quantized is op.paged_attention_decode_quantized.default
                    and cls._prefill_quantized is op.paged_attention_prefill_quantized.default)
