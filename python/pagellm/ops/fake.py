"""Fake (meta) implementations of every torch.ops.pagellm op, for torch.compile and opcheck.

Every op but fused_moe writes into tensors it is given and returns nothing, so its fake is a no-op;
fused_moe returns a new [T, H] tensor in hidden's dtype.
Imported by pagellm.ops once the ops are registered.
"""

from __future__ import annotations

import torch


def pagellm_op_names() -> list[str]:
    """Every registered torch.ops.pagellm op, e.g. ["copy_blocks", ...] (from the dispatcher, not a list here)."""
    return sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("pagellm::"))


def _noop(*args, **kwargs) -> None:
    return None


def _fused_moe_fake(hidden, w13, w2, topk_weights, topk_ids, activation):
    return hidden.new_empty(hidden.shape)


# ops that return tensors: their own fakes
_RETURNING_FAKES = {"fused_moe": _fused_moe_fake}


_registered = False


def register_fakes() -> None:
    global _registered
    if _registered:
        return
    for name in pagellm_op_names():
        torch.library.register_fake(f"pagellm::{name}", _RETURNING_FAKES.get(name, _noop))
    _registered = True
