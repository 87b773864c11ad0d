"""Error-compensated rounding into AWQ's format: GPTQ (Frantar et al. 2023, "GPTQ: Accurate Post-Training
Quantization for Generative Pre-trained Transformers"), on plain tensors.

    gptq_quantize(w, gram, G)   W [out, in] -> (q uint8 [out, in], zeros uint8 [out, in / G],
                                scales float16 [out, in / G]): AWQ's asymmetric 4-bit groups, each weight
                                W[n, k] ~ (q[n, k] - zeros[n, k // G]) * scales[n, k // G]

Round-to-nearest minimizes each weight's own error; what matters is the linear's output error
||x (Q - W)^T||^2 = sum_n e_n H e_n^T with H = x^T x (`InputStats.gram`). GPTQ rounds the input columns one
after another (in the natural order: AutoAWQ's layout has no g_idx, so no act-order) and after rounding
column k moves the remaining, not yet rounded columns of every row so that they cancel k's error as well as
H allows: W[:, k+1:] -= e_k / U[k, k] * U[k, k+1:], U the upper Cholesky factor of H^-1 (of H damped by
`damp` x its mean diagonal, so it is invertible). A group's scale and zero point are fixed when its first
column comes up, from the then-updated weights (their min / max, or a clip search's bounds on the group's
partial output error with H's diagonal block, like `awq_search.search_clip`; or, with `group_search`, the
(scale, zero) pair `awq_group_search` finds on the same error), so the result is exactly
AWQ's format: fp16 scales, integer zero points in 0..15, q in 0..15.

Columns are processed in blocks of `block_columns` (a multiple of G): the rank-1 updates stay inside the
block and the rest of W gets one matmul per block ("lazy batch updates"). Everything is float32, the
Cholesky factors float64.
"""

from __future__ import annotations

import torch

from pagellm.quantization.awq_group_search import search_group_params
from pagellm.quantization.awq_search import InputStats, search_clip

DAMP_FRACTION = 0.01  # H + damp * mean(diag H) * I (GPTQ's default percdamp)
BLOCK_COLUMNS = 128


def inverse_hessian_factor(gram: torch.Tensor, damp: float = DAMP_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    """(U [in, in] float32: the upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, dead [in] bool:
    inputs that were always 0, whose H row is replaced by the identity's so H stays invertible)."""
    if not damp > 0:
        raise ValueError(f"damp must be > 0, got {damp}")
    h = gram.to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * torch.diagonal(h).mean())
    h_inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(h_inv, upper=True).to(torch.float32), dead


def group_params(w_group: torch.Tensor, lo: torch.Tensor | None = None,
                 hi: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale float32 [out] (fp16-rounded), zero float32 [out] (integer 0..15)) of a group's weights
    [out, G] between their min and max (within [lo, hi] when given), as `quantize_awq` computes them."""
    w_min, w_max = w_group.amin(dim=1), w_group.amax(dim=1)
    if lo is not None:
        w_min, w_max = torch.maximum(w_min, lo), torch.minimum(w_max, hi)
    scale = ((w_max - w_min).clamp(min=1e-5) / 15).to(torch.float16).to(torch.float32)
    zero = torch.clamp(torch.round(-w_min / scale), 0, 15)
    return scale, zero


def gptq_quantize(w: torch.Tensor, gram: torch.Tensor, group_size: int, *, clip: bool = False,
                  group_search: bool = False, damp: float = DAMP_FRACTION,
                  block_columns: int = BLOCK_COLUMNS) -> tuple[
                      torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] with its input's Gram matrix `gram` [in, in] -> (q uint8 [out, in], zeros uint8
    [out, in / G], scales float16 [out, in / G]) (see the module doc). `clip`: each group's bounds from a
    clip search on the updated weights (AWQ's symmetric grid) instead of their min / max; `group_search`: each
    group's (scale, zero) from `awq_group_search.search_group_params` on the updated weights (supersedes `clip`)."""
    out_features, in_features = w.shape
    if in_features % group_size or gram.shape != (in_features, in_features):
        raise ValueError(f"W {tuple(w.shape)} needs in % group_size == 0 (group_size={group_size}) and a Gram "
                         f"matrix [{in_features}, {in_features}], got {tuple(gram.shape)}")
    u, dead = inverse_hessian_factor(gram, damp)
    work = w.to(torch.float32).clone()
    work[:, dead] = 0.0
    num_groups = in_features // group_size
    q = torch.empty(out_features, in_features, dtype=torch.uint8)
    scales = torch.empty(out_features, num_groups)
    zeros = torch.empty(out_features, num_groups)
    block = max(1, block_columns // group_size) * group_size  # whole groups per block
    for b0 in range(0, in_features, block):
        b1 = min(b0 + block, in_features)
        cols = work[:, b0:b1]  # a view: updated in place
        errors = torch.empty_like(cols)
        for i in range(b1 - b0):
            k = b0 + i
            if k % group_size == 0:
                g, w_group = k // group_size, cols[:, i:i + group_size]
                block_gram = gram[k:k + group_size, k:k + group_size]
                if group_search:
                    s, z = search_group_params(w_group, block_gram, group_size)
                    scales[:, g], zeros[:, g] = s[:, 0], z[:, 0]
                else:
                    bounds = _clip_bounds(w_group, block_gram) if clip else (None, None)
                    scales[:, g], zeros[:, g] = group_params(w_group, *bounds)
            s, z = scales[:, k // group_size], zeros[:, k // group_size]
            qk = torch.clamp(torch.round(cols[:, i] / s) + z, 0, 15)
            q[:, k] = qk.to(torch.uint8)
            err = (cols[:, i] - (qk - z) * s) / u[k, k]
            cols[:, i + 1:] -= err.unsqueeze(1) * u[k, k + 1:b1].unsqueeze(0)
            errors[:, i] = err
        work[:, b1:] -= errors @ u[b0:b1, b1:]
    return q, zeros.to(torch.uint8), scales.to(torch.float16)


def _clip_bounds(w_group: torch.Tensor, gram_block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`search_clip`'s (min, max) [out] for one group's current weights [out, G], judged on the group's
    partial output error with its Gram block."""
    stats = InputStats(gram_block.to(torch.float32), torch.zeros(gram_block.shape[0]), 0)
    lo, hi = search_clip(stats, w_group, w_group.shape[1])
    return lo[:, 0], hi[:, 0]


def dequantize_groups(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 W [out, in] of `gptq_quantize`'s output: (q - zero) * scale per (row, group)."""
    z = zeros.to(torch.float32).repeat_interleave(group_size, dim=1)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=1)
    return (q.to(torch.float32) - z) * s
