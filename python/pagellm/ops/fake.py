"""Fake (meta) implementations of every torch.ops.pagellm op, for torch.compile and opcheck.

Every op writes into tensors it is given and returns nothing, so each fake is a no-op.
Imported by pagellm.ops once the ops are registered.
"""

from __future__ import annotations

import torch

_OPS = (
    "reshape_and_cache",
    "copy_blocks",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_and_mul",
    "linear_small_m",
)


def _noop(*args, **kwargs) -> None:
    return None


_registered = False


def register_fakes() -> None:
    global _registered
    if _registered:
        return
    for name in _OPS:
        torch.library.register_fake(f"pagellm::{name}", _noop)
    _registered = True
