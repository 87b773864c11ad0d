"""Row gathers of a step (the token embedding lookup, the sampling rows' hidden states) on pagellm's
`gather_rows` op for CPU tensors: ATen's index_select / index open an OpenMP region above 32k elements,
which on a loaded machine waited milliseconds for a preempted worker in every decode step. Everything
else (other devices, autograd, no compiled ops) is plain torch indexing, with the same values."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import pagellm.ops as _compiled

    _gather_rows = torch.ops.pagellm.gather_rows.default if _compiled.ops_available()[0] else None
except Exception:  # pragma: no cover - depends on the build
    _gather_rows = None


def _use_op(src: torch.Tensor, index: torch.Tensor) -> bool:
    return (_gather_rows is not None and src.is_cpu and index.is_cpu and src.dim() == 2
            and index.dtype in (torch.int64, torch.int32)
            and not (torch.is_grad_enabled() and src.requires_grad))


def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """src [R, D], index [N] (int64 / int32) -> src[index] [N, D]."""
    if index.dim() == 1 and _use_op(src, index):
        out = torch.empty((index.shape[0], src.shape[1]), dtype=src.dtype)
        _gather_rows(out, src, index)
        return out
    return src[index]


def embedding(token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding(token_ids, weight): token_ids [...] -> [..., D]."""
    if _use_op(weight, token_ids):
        flat = token_ids.reshape(-1)
        out = torch.empty((flat.shape[0], weight.shape[1]), dtype=weight.dtype)
        _gather_rows(out, weight, flat)
        return out.view(*token_ids.shape, weight.shape[1])
    return F.embedding(token_ids, weight)
