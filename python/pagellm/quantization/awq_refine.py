"""Coordinate descent on a rounded AWQ linear's output error, after GPTQ (or any rounding), on plain tensors.

    refine_rounding(w, q, zeros, scales, gram, G)   -> (q, zeros, scales), the same format, whose (damped) output
                                                      error sum_n e_n H e_n^T (e = dequantized - W) is never larger

GPTQ decides each column once, in order, and the group search judges a group on its own Gram block only; neither
revisits a decision once later columns are rounded. The error is an exact quadratic in the integers, so a
greedy pass over them (as CDQuant, Nair & Suggala 2024, does after GPTQ) keeps P = E H [out, in] up to date
and, per coordinate, takes the move with the most negative change of the objective:

    q[n, k] +- 1        e_k += +-s: delta = +-2 s P[n, k] + s^2 H[k, k]
    scales[n, g]        fp16(s (1 +- r)) for r in `SCALE_STEPS`: e_g += (q - z) (s' - s), delta from P and H_gg

(A zero point's +-1 alone shifts the whole group by -+s, which the q moves before it already weighed weight by
weight: tried, never taken on GPTQ's or RTN's roundings of Q4_1-grid weights, so zero points stay as given.)
A sweep visits the groups in order, each group's columns, then its scale, every row at once; P's other
columns are brought up to date once per group (one [out, G] x [G, in] product). Sweeps stop
early when nothing moves. H is the Gram matrix damped, H + damp * mean(diag H) * I, more than GPTQ's
(`REFINE_DAMP`): the damping term is a weight-space error that keeps the refinement from fitting the
calibration tokens' noise. Everything is float64 (P takes thousands of rank-1 updates).
"""

from __future__ import annotations

import torch

SCALE_STEPS = (1 / 64, 1 / 32)  # a group's scale tried at fp16(s * (1 +- r))
# H + REFINE_DAMP * mean(diag H) * I: 20x GPTQ's 1 %. The refinement fits the calibration tokens' Gram matrix
# closely enough to overfit it: on the default model's layer 3 (8192 calibration tokens, error on 4096 others)
# down_proj's held-out error went 1.006x GPTQ's at damp 0.01, 0.944x at 0.2; q/k/v/o/gate/up 0.88-0.97x ->
# 0.86-0.94x (benchmarks/README.md session 17)
REFINE_DAMP = 0.2


def damped_gram(gram: torch.Tensor, damp: float) -> torch.Tensor:
    """float64 H + damp * mean(diag H) * I (damp >= 0)."""
    h = gram.to(torch.float64).clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    return h


def output_objective(w: torch.Tensor, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                     gram: torch.Tensor, group_size: int, damp: float = 0.0) -> float:
    """sum_n e_n H e_n^T in float64, e = (q - zero) * scale - W, H damped by `damp` (see the module doc)."""
    e = _dequantize64(q, zeros, scales, group_size) - w.to(torch.float64)
    return float(((e @ damped_gram(gram, damp)) * e).sum())


def _dequantize64(q, zeros, scales, group_size):
    z = zeros.to(torch.float64).repeat_interleave(group_size, dim=1)
    s = scales.to(torch.float64).repeat_interleave(group_size, dim=1)
    return (q.to(torch.float64) - z) * s


def _check(w, q, zeros, scales, gram, group_size, sweeps):
    out_features, in_features = w.shape
    if (group_size <= 0 or in_features % group_size or q.shape != w.shape
            or zeros.shape != (out_features, in_features // group_size) or scales.shape != zeros.shape
            or gram.shape != (in_features, in_features)):
        raise ValueError(f"refine_rounding needs W and q [out, in] with in % group_size == 0, zeros / scales "
                         f"[out, in / G] and a Gram matrix [in, in]; got W {tuple(w.shape)}, q {tuple(q.shape)}, "
                         f"zeros {tuple(zeros.shape)}, scales {tuple(scales.shape)}, gram {tuple(gram.shape)}, "
                         f"group_size={group_size}")
    if scales.dtype != torch.float16:
        raise TypeError(f"scales must be float16 (AWQ's), got {scales.dtype}")
    if not isinstance(sweeps, int) or sweeps < 1:
        raise ValueError(f"sweeps must be a positive integer, got {sweeps!r}")


def refine_rounding(w: torch.Tensor, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                    gram: torch.Tensor, group_size: int, *, sweeps: int = 2, damp: float = REFINE_DAMP,
                    scale_steps: tuple[float, ...] = SCALE_STEPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] (the float weight the rounding approximates), its rounding q uint8 [out, in], zeros uint8 /
    scales float16 [out, in / G], the input's Gram matrix [in, in] -> the refined (q, zeros, scales) (module
    doc); q and zeros stay in 0..15, scales fp16 and positive."""
    _check(w, q, zeros, scales, gram, group_size, sweeps)
    h = damped_gram(gram, damp)
    qf, z = q.to(torch.float64).clone(), zeros.to(torch.float64).clone()
    s = scales.to(torch.float64).clone()
    e = _dequantize64(q, zeros, scales, group_size) - w.to(torch.float64)
    p = e @ h
    h_diag = h.diagonal()
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    for _ in range(sweeps):
        moved = 0
        for g in range(w.shape[1] // group_size):
            c0, c1 = g * group_size, (g + 1) * group_size
            h_gg = h[c0:c1, c0:c1]
            d_e = torch.zeros(w.shape[0], group_size, dtype=torch.float64)
            sg = s[:, g]
            for k in range(c0, c1):  # each weight +-1
                base = sg * sg * h_diag[k]
                up = torch.where(qf[:, k] < 15, 2 * sg * p[:, k] + base, inf)
                down = torch.where(qf[:, k] > 0, -2 * sg * p[:, k] + base, inf)
                step = torch.where((up < down) & (up < 0), 1.0, torch.where(down < 0, -1.0, 0.0))
                if not step.any():
                    continue
                moved += int(step.count_nonzero())
                de = step * sg
                qf[:, k] += step
                d_e[:, k - c0] += de
                p[:, c0:c1] += de.unsqueeze(1) * h[k, c0:c1].unsqueeze(0)
            # the group's scale
            levels = qf[:, c0:c1] - z[:, g:g + 1]
            best_delta = torch.zeros_like(sg)
            best_scale = sg.clone()
            for r in scale_steps:
                for sign in (1.0, -1.0):
                    cand = (sg * (1 + sign * r)).to(torch.float16).to(torch.float64)
                    de = levels * (cand - sg).unsqueeze(1)
                    delta = 2 * (de * p[:, c0:c1]).sum(dim=1) + ((de @ h_gg) * de).sum(dim=1)
                    better = (delta < best_delta) & (cand > 0) & torch.isfinite(cand)
                    best_delta = torch.where(better, delta, best_delta)
                    best_scale = torch.where(better, cand, best_scale)
            changed = best_scale != sg
            if changed.any():
                moved += int(changed.count_nonzero())
                de = levels * (best_scale - sg).unsqueeze(1)
                d_e += de
                p[:, c0:c1] += de @ h_gg
                s[:, g] = best_scale
            # the other columns of P, once per group
            rest = d_e @ h[c0:c1]
            p[:, :c0] += rest[:, :c0]
            p[:, c1:] += rest[:, c1:]
        if not moved:
            break
    return qf.to(torch.uint8), z.to(torch.uint8), s.to(torch.float16)
