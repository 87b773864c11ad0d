"""The `cuda` attention backend: the CUDA kernels behind torch.ops.pagellm.* on CUDA tensors.

Decodes (the first num_decode_reqs requests, one token each) go through paged_attention_decode
(GQA-grouped, flash-decoding split for long contexts / small batches), the remaining prefill chunks
through paged_attention_prefill (tensor-core flash attention over the paged cache); both write into
one preallocated output. MLA layers (DeepSeek) read only this backend's metadata: their decodes run
`paged_mla_decode` (the decode kernel at QK width 576, value width 512; attention/mla.py, ops/mla.py).
See docs/cuda.md.
"""

from __future__ import annotations

import torch

from pagellm import ops
from pagellm.attention.registry import register_attention_backend
from pagellm.attention.torch_backend import PagedBackendBase
from pagellm.kv_cache import PagedKVCache
from pagellm.ops import fused_dispatch

_rope_and_cache = torch.ops.pagellm.rotary_embedding_and_cache.default if ops.ops_available()[0] else None


def _has_cuda_kernel(op_name: str) -> bool:
    """Whether torch.ops.pagellm.<op_name> has a CUDA kernel registered (pagellm._C built with CUDA)."""
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"pagellm::{op_name}", "CUDA"))
    except (AttributeError, RuntimeError):
        return False


@register_attention_backend("cuda")
class CudaAttentionBackend(PagedBackendBase):
    """CUDA paged attention (sm_80+; head dims 64, 80, 96, 112, 128, 256; float, int8 and fp8 KV caches)."""

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        device = torch.device(device)
        if device.type != "cuda":
            return False, f"the cuda backend runs on CUDA tensors only, not {device}"
        ok, why = ops.ops_available()
        if not ok:
            return False, why
        if not torch.cuda.is_available():
            return False, "torch.cuda.is_available() is False"
        if not _has_cuda_kernel("paged_attention_decode"):
            return False, "pagellm._C was built without CUDA kernels (torch without CUDA or no nvcc at build time)"
        return True, ""

    def rope_and_write(self, layer, query, key, value, kv_cache, rotary_emb, positions) -> bool:
        """rotary_embedding_and_cache (one kernel) under fused_dispatch.CUDA_FUSE_ROPE_CACHE, for a float cache and a
        step without padded tokens past the metadata's; otherwise False (the two ops)."""
        md = self.metadata
        if (not fused_dispatch.CUDA_FUSE_ROPE_CACHE or md is None or not isinstance(kv_cache, PagedKVCache)
                or kv_cache.k_scale is not None or query.shape[0] != md.num_tokens):
            return False
        _rope_and_cache(positions, query, key, value, kv_cache.key_cache, kv_cache.value_cache, md.slot_mapping,
                        rotary_emb.head_size, rotary_emb.cos_sin_cache, rotary_emb.is_neox_style)
        return True

    _write = staticmethod(ops.reshape_and_cache)
    _decode = staticmethod(ops.paged_attention_decode)
    _prefill = staticmethod(ops.paged_attention_prefill)
    _write_quantized = staticmethod(ops.reshape_and_cache_quantized)
    _decode_quantized = staticmethod(ops.paged_attention_decode_quantized)
    _prefill_quantized = staticmethod(ops.paged_attention_prefill_quantized)
