"""Fake (meta) implementations of every torch.ops.pagellm op, for torch.compile and opcheck.

Every op writes into tensors it is given and returns nothing, so each fake is a no-op.
Imported by pagellm.ops once the ops are registered.
"""

from __future__ import annotations

import torch


def pagellm_op_names() -> list[str]:
    """Every registered torch.ops.pagellm op, e.g. ["copy_blocks", ...] (from the dispatcher, not a list here)."""
    return sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("pagellm::"))


def _noop(*args, **kwargs) -> None:
    return None


_registered = False


def register_fakes() -> None:
    global _registered
    if _registered:
        return
    for name in pagellm_op_names():
        torch.library.register_fake(f"pagellm::{name}", _noop)
    _registered = True
