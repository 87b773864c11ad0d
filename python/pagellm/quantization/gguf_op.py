"""The gguf_linear callable both GGUF linear methods use (the compiled op, else its pure-torch reference) and
the block types it multiplies natively. Its own module so `gguf.py` and `gguf_mixed.py` need not import each other;
both call `gguf_op.gguf_linear_op` through this module, so one patch of it (tests: the reference) reaches both."""

from __future__ import annotations

import torch

from pagellm.ops.reference import GGUF_QTYPES
from pagellm.ops.reference import gguf_linear as reference_gguf_linear

try:
    import pagellm.ops as _compiled

    gguf_linear_op = (torch.ops.pagellm.gguf_linear.default
                      if _compiled.ops_available()[0] and hasattr(torch.ops.pagellm, "gguf_linear") else None)
except Exception:  # pragma: no cover - depends on the build
    gguf_linear_op = None
if gguf_linear_op is None:  # pragma: no cover - depends on the build
    gguf_linear_op = reference_gguf_linear  # same signature and semantics, pure torch


def supported_gguf_types() -> list[str]:
    """The GGUF block types multiplied natively (others are refused by the loader)."""
    return list(GGUF_QTYPES)
