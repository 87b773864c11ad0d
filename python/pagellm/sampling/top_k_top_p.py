"""Top-k / top-p (nucleus) masking: the sort-based definition and a CPU fast path with the same result.

`apply_top_k_top_p_sorted` is the definition: sort each row (values and indices), mask in sorted order, scatter
the mask back. On a CPU the index sort of a 49k-token row is ~2.6 ms (torch's std::sort with indices), most of a
sampled batch-1 step's host time. `apply_top_k_top_p` gets the same tensor without the index sort:

* the sorted *values* of a row are unique whatever order a sort gives tied entries, so numpy's SIMD value sort
  (~0.08 ms a row) feeds the same softmax and cumulative sum, bit for bit, as the index sort did;
* the masked *tokens* are then a value threshold: top-k keeps every value >= the k-th (ties kept, as before), and
  top-p keeps the sorted prefix up to its last kept position c, i.e. every value >= value[c], unless that position
  splits a run of equal values (which of the tied tokens the old path kept depended on std::sort's tie order) or
  the mask is not a prefix (float rounding of cum - p). Those rows, and rows with a NaN, take the sorted path.
"""

from __future__ import annotations

import numpy as np
import torch

_NEG_INF = float("-inf")


def apply_top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None,
                             top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (with -inf) tokens outside each row's top-k and nucleus. Ties at the k-th value are kept."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
        mask |= sorted_logits == _NEG_INF
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = probs.cumsum(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the first is always kept)
        mask |= (cum - probs) >= top_p.unsqueeze(1)
        mask[:, 0] = False
    full_mask = torch.empty_like(mask).scatter_(1, sorted_idx, mask)
    return logits.masked_fill(full_mask, _NEG_INF)


def _keep_thresholds(logits: torch.Tensor, top_k: torch.Tensor | None,
                     top_p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the smallest kept value (float32 [N, 1]) and whether the row's kept set is exactly the values >= it
    (bool [N]; False: a NaN, a nucleus cut inside a run of tied values, or a mask that is not a prefix)."""
    x = logits.numpy()
    exact = torch.from_numpy(~np.isnan(x).any(axis=1))
    values = torch.from_numpy(-np.sort(-x, axis=-1))  # descending; -x is exact
    if top_k is not None:
        kth = values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
        if top_p is None:
            return kth, exact
        values = values.masked_fill(values < kth, _NEG_INF)
    probs = torch.softmax(values, dim=-1)
    cum = probs.cumsum(dim=-1)
    mask = (cum - probs) >= top_p.unsqueeze(1)
    if top_k is not None:
        mask |= values == _NEG_INF
    mask[:, 0] = False  # last, as in the sorted path
    num_kept = (~mask).sum(dim=1)
    exact &= ~mask[:, :-1].gt(mask[:, 1:]).any(dim=1)  # a prefix: the kept positions are the first num_kept
    threshold = values.gather(1, (num_kept - 1).unsqueeze(1))
    after = values.gather(1, num_kept.clamp(max=values.shape[1] - 1).unsqueeze(1))
    # the first dropped value must be strictly smaller (a row that keeps everything has nothing after)
    exact &= ~((after == threshold) & (num_kept < values.shape[1]).unsqueeze(1)).squeeze(1)
    exact &= ~torch.isinf(threshold).squeeze(1)
    return threshold, exact


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """`apply_top_k_top_p_sorted`'s result (the same tensor, bit for bit), through value thresholds where it can:
    float32 CPU logits [N, V]; other tensors sort, and so do the rows whose kept set is not a threshold (rows are
    independent in the sorted path, so those rows alone are sorted)."""
    if top_k is None and top_p is None:
        return logits
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0:
        return apply_top_k_top_p_sorted(logits, top_k, top_p)
    threshold, exact = _keep_thresholds(logits.contiguous(), top_k, top_p)
    out = logits.masked_fill(logits < threshold, _NEG_INF)
    if not bool(exact.all()):
        rows = (~exact).nonzero().flatten()
        out[rows] = apply_top_k_top_p_sorted(logits[rows], None if top_k is None else top_k[rows],
                                             None if top_p is None else top_p[rows])
    return out
