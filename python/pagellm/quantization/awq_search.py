"""AWQ's two searches (Lin et al. 2024, "AWQ: Activation-aware Weight Quantization"), on plain tensors.

    pseudo_quantize(w, G)             W [out, in] -> the float weight `quantize_awq` + `dequantize_awq` give
                                      (asymmetric 4-bit round-to-nearest per (row, group of G inputs), fp16 scales)
    search_scale(stats, weights, G)   the per-input-channel scale s = mean|x|^alpha / mean_w^(1 - alpha) (alpha
                                      on a grid; AutoAWQ's default "duo scaling", mean_w = weight_scales) that
                                      minimizes || x W^T - (x / s) Q(W diag(s))^T ||^2 over linears sharing x
    search_clip(stats, w, G)          per (row, group) a symmetric clip [-m, m], m = absmax * (1 - i / grid),
                                      minimizing the error of the group's partial output sum_k x[t, k] W[n, k]
                                      (AutoAWQ's auto_clip)

Both errors are quadratic in the weight error E: ||x E^T||^2 = sum((E H) * E) with the Gram matrix H = x^T x
[in, in] of the linears' input, and a group's partial output error is E_g H_gg E_g^T with H's diagonal block.
So a layer's inputs are summarized once (`InputStats`: H, sum |x|, token count) and the searches cost
O(out * in^2) per grid point whatever the number of calibration tokens: the same objectives as AutoAWQ's
(which evaluates them on the activations, the clip search on 512 sampled tokens), over every token.
Everything is float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

NUM_SCALE_GRID = 20  # alpha = i / 20, i = 0..19 (AutoAWQ's grid; alpha = 0 is plain RTN)
NUM_CLIP_GRID = 20
MAX_CLIP_SHRINK = 0.5  # clip ranges down to half of the group's range


@dataclass
class InputStats:
    """What the searches need of a linear's input x [tokens, in]: gram = x^T x [in, in], abs_sum = sum_t |x| [in]."""
    gram: torch.Tensor
    abs_sum: torch.Tensor
    num_tokens: int = 0

    @classmethod
    def empty(cls, in_features: int) -> "InputStats":
        return cls(torch.zeros(in_features, in_features), torch.zeros(in_features), 0)

    def add(self, x: torch.Tensor) -> None:
        """Accumulate x [..., in]."""
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        self.gram += x.t() @ x
        self.abs_sum += x.abs().sum(dim=0)
        self.num_tokens += x.shape[0]

    def scaled(self, s: torch.Tensor) -> "InputStats":
        """A new InputStats of x / s (this one unchanged)."""
        return InputStats(self.gram / (s.view(-1, 1) * s.view(1, -1)), self.abs_sum / s, self.num_tokens)

    def divide_inputs(self, s: torch.Tensor) -> None:
        """The statistics of x / s (after s was folded out of the producer)."""
        self.gram /= s.view(-1, 1) * s.view(1, -1)
        self.abs_sum /= s


def pseudo_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [out, in] -> float32 [out, in]: each (row, group) rounded to 16 levels between its min and max,
    with the scale rounded to float16 first: exactly `dequantize_awq(*quantize_awq(w, G), G)`."""
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"in_features={in_features} is not a multiple of group_size={group_size}")
    g = w.to(torch.float32).reshape(out_features, -1, group_size)
    w_min, w_max = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    scale = ((w_max - w_min).clamp(min=1e-5) / 15).to(torch.float16).to(torch.float32)
    zero = torch.clamp(torch.round(-w_min / scale), 0, 15)
    q = torch.clamp(torch.round(g / scale) + zero, 0, 15)
    return ((q - zero) * scale).reshape(out_features, in_features)


def weight_scales(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """AutoAWQ's w_mean [in]: |W| / (its (row, group) absmax + 1e-6), averaged over the rows of all `weights`
    (the linears sharing one input, stacked): how large each input channel's weights are within their groups."""
    w = torch.cat([w.to(torch.float32) for w in weights], 0)
    g = w.abs().reshape(-1, group_size)
    return (g / (g.amax(dim=1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)


def activation_scales(mean_abs: torch.Tensor, alpha: float, w_mean: torch.Tensor | None = None) -> torch.Tensor:
    """s [in] = mean|x|^alpha, or with `w_mean` (duo scaling) mean|x|^alpha / (w_mean^(1 - alpha) + 1e-4),
    normalized so that max(s) * min(s) = 1 (as AutoAWQ: keeps W * s in range)."""
    s = mean_abs.pow(alpha)
    if w_mean is not None:
        s = s / (w_mean.pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))  # AutoAWQ: inf / NaN scales -> 1


def output_error(gram: torch.Tensor, error: torch.Tensor) -> float:
    """||x E^T||^2 summed over tokens and outputs, from the Gram matrix of x: sum((E H) * E)."""
    return float(((error @ gram) * error).sum())


def scaled_quantization_error(stats: InputStats, weights: list[torch.Tensor], s: torch.Tensor,
                              group_size: int) -> float:
    """Mean squared error of (x / s) Q(W_i diag(s))^T against x W_i^T over all tokens and outputs."""
    total, outputs = 0.0, 0
    for w in weights:
        ws = w.to(torch.float32) * s
        total += output_error(stats.gram, (pseudo_quantize(ws, group_size) - ws) / s)
        outputs += w.shape[0]
    return total / (max(stats.num_tokens, 1) * outputs)


def search_scale(stats: InputStats, weights: list[torch.Tensor], group_size: int,
                 num_grid: int = NUM_SCALE_GRID, duo_scaling: bool = True) -> tuple[torch.Tensor, list[float]]:
    """The best s [in] for linears W_i [out_i, in] reading the input summarized by `stats`, and the mean
    squared output error of plain round-to-nearest (s = 1) followed by that of every grid point alpha = i / grid.
    s = 1 is kept when no grid point beats it (AutoAWQ would take the best grid point even then)."""
    mean_abs = stats.abs_sum / max(stats.num_tokens, 1)
    w_mean = weight_scales(weights, group_size) if duo_scaling else None
    best = torch.ones_like(mean_abs)
    best_loss = scaled_quantization_error(stats, weights, best, group_size)
    losses = [best_loss]
    for i in range(num_grid):
        s = activation_scales(mean_abs, i / num_grid, w_mean)
        loss = scaled_quantization_error(stats, weights, s, group_size)
        losses.append(loss)
        if loss < best_loss:
            best, best_loss = s, loss
    return best, losses


def search_scale_by_rounding(stats: InputStats, weights: list[torch.Tensor], group_size: int,
                             rounded_error: Callable[[torch.Tensor], float], alphas: tuple[float, ...],
                             duo_scaling: bool = True) -> tuple[torch.Tensor, list[float]]:
    """The s [in] among s = 1 and `activation_scales` at `alphas` whose `rounded_error(s)` (the output error of the
    linears' weights W_i diag(s) as the calibration will really round them, on inputs x / s) is least, and the
    errors (s = 1's first). Ties keep the earlier candidate, so s = 1 wins unless a scale is strictly better."""
    mean_abs = stats.abs_sum / max(stats.num_tokens, 1)
    w_mean = weight_scales(weights, group_size) if duo_scaling else None
    best = torch.ones_like(mean_abs)
    losses = [rounded_error(best)]
    for alpha in alphas:
        s = activation_scales(mean_abs, alpha, w_mean)
        losses.append(rounded_error(s))
        if losses[-1] < min(losses[:-1]):
            best = s
    return best, losses


def group_output_errors(stats: InputStats, error: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per (row, group): sum over tokens of (x_g . E[n, g])^2 -> [out, in / G], from H's diagonal blocks."""
    num_groups = error.shape[1] // group_size
    e = error.reshape(error.shape[0], num_groups, group_size)
    idx = torch.arange(num_groups)
    blocks = stats.gram.reshape(num_groups, group_size, num_groups, group_size)[idx, :, idx, :]  # [groups, G, G]
    return (torch.einsum("ngk,gkl->ngl", e, blocks) * e).sum(dim=2)


def search_clip(stats: InputStats, w: torch.Tensor, group_size: int, num_grid: int = NUM_CLIP_GRID,
                max_shrink: float = MAX_CLIP_SHRINK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, group) clip bounds (min [out, in / G], max [out, in / G]) = (-m, m) with m the group's absmax
    times (1 - i / num_grid), i < max_shrink * num_grid, picking per (row, group) the i whose quantized weight
    gives the smallest error of the group's partial output (AutoAWQ's auto_clip: symmetric bounds, so only the
    side of the group's largest magnitude is ever clipped)."""
    w = w.to(torch.float32)
    org_absmax = w.abs().reshape(w.shape[0], -1, group_size).amax(dim=2)
    best_err = torch.full_like(org_absmax, float("inf"))
    best_min, best_max = -org_absmax, org_absmax.clone()
    for i in range(int(max_shrink * num_grid)):
        cur_max = org_absmax * (1 - i / num_grid)
        cur_min = -cur_max
        q = pseudo_quantize(apply_clip(w, cur_min, cur_max, group_size), group_size)
        err = group_output_errors(stats, q - w, group_size)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_min = torch.where(better, cur_min, best_min)
        best_max = torch.where(better, cur_max, best_max)
    return best_min, best_max


def apply_clip(w: torch.Tensor, clip_min: torch.Tensor, clip_max: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [out, in] clamped per (row, group) to [clip_min, clip_max] ([out, in / G] each)."""
    g = w.reshape(w.shape[0], -1, group_size)
    lo, hi = clip_min.unsqueeze(2).to(w.dtype), clip_max.unsqueeze(2).to(w.dtype)
    return torch.max(torch.min(g, hi), lo).reshape_as(w)
