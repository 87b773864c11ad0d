"""Each AWQ group's (scale, integer zero point) searched on the linear's output error, on plain tensors.

Round-to-nearest (`quantize_awq`) takes a group's scale from its range, (max - min) / 15, and its zero point
round(-min / scale). On weights that already lie on a 4-bit grid with a float minimum (GGUF Q4_1:
w = d * q' + m per block of 32, the default model's float weights) that scale is d and the integer zero
point moves every weight of the group by the fractional part of m / d: up to d / 2, as large as rounding
random weights, and the same sign along the group. (With float zero points the round trip is exact.)
Other pairs trade that shift for errors that vary along the group and cancel in the output, so each
(row, group) tries

    scale = fp16(ratio * (max - min) / 15)  for ratio in `SEARCH_RATIOS` (1 included: RTN's own scale)
    zero  = clamp(round(-min / scale) + dz, 0, 15)  for dz in (-1, 0, 1)
    q     = clamp(round(w / scale) + zero, 0, 15)

and keeps the pair with the least partial output error e H_gg e^T of the group (e = (q - zero) * scale - w,
H_gg the group's diagonal block of the input's Gram matrix, as `awq_search.search_clip` judges clipping).
Ratios below 1 clip the group's ends, so the search replaces the clip search where it is used. RTN's pair is
a candidate, so no group gets worse than RTN on the calibration inputs. Everything is float32.
"""

from __future__ import annotations

import torch

SEARCH_RATIOS = tuple(1 + i / 50 for i in range(-10, 16))  # 0.80 .. 1.30 in steps of 0.02
ZERO_OFFSETS = (-1, 0, 1)


def _diagonal_blocks(gram: torch.Tensor, group_size: int) -> torch.Tensor:
    """H [in, in] -> its diagonal blocks [in / G, G, G]."""
    num_groups = gram.shape[0] // group_size
    idx = torch.arange(num_groups)
    return gram.reshape(num_groups, group_size, num_groups, group_size)[idx, :, idx, :]


def search_group_params(w: torch.Tensor, gram: torch.Tensor, group_size: int,
                        ratios: tuple[float, ...] = SEARCH_RATIOS,
                        zero_offsets: tuple[int, ...] = ZERO_OFFSETS) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] and its input's Gram matrix [in, in] -> (scales float32 [out, in / G], fp16-rounded;
    zeros float32 [out, in / G], integers 0..15): per (row, group) the candidate pair (module doc) with the
    least partial output error; ties keep the earlier candidate (ratio order, then `zero_offsets` order)."""
    out_features, in_features = w.shape
    if in_features % group_size or gram.shape != (in_features, in_features):
        raise ValueError(f"W {tuple(w.shape)} needs in % group_size == 0 (group_size={group_size}) and a Gram "
                         f"matrix [{in_features}, {in_features}], got {tuple(gram.shape)}")
    if not ratios or any(not r > 0 for r in ratios):
        raise ValueError(f"ratios must be a non-empty sequence of positive numbers, got {ratios}")
    g = w.to(torch.float32).reshape(out_features, -1, group_size)
    blocks = _diagonal_blocks(gram.to(torch.float32), group_size)
    w_min = g.amin(dim=2)
    base = (g.amax(dim=2) - w_min).clamp(min=1e-5) / 15
    best_err = torch.full_like(w_min, float("inf"))
    best_scale, best_zero = torch.empty_like(w_min), torch.empty_like(w_min)
    for ratio in ratios:
        scale = (base * ratio).to(torch.float16).to(torch.float32)
        z0 = torch.round(-w_min / scale)
        for dz in zero_offsets:
            zero = torch.clamp(z0 + dz, 0, 15)
            q = torch.clamp(torch.round(g / scale.unsqueeze(2)) + zero.unsqueeze(2), 0, 15)
            e = (q - zero.unsqueeze(2)) * scale.unsqueeze(2) - g
            err = (torch.einsum("ngk,gkl->ngl", e, blocks) * e).sum(dim=2)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def round_to_groups(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] on given per-group scales / zeros [out, in / G] -> (q uint8 [out, in], zeros uint8,
    scales float16): `awq_format.pack_awq`'s input."""
    g = w.to(torch.float32).reshape(w.shape[0], -1, group_size)
    q = torch.clamp(torch.round(g / scales.unsqueeze(2)) + zeros.unsqueeze(2), 0, 15)
    return q.reshape(w.shape).to(torch.uint8), zeros.to(torch.uint8), scales.to(torch.float16)


def search_quantize(w: torch.Tensor, gram: torch.Tensor, group_size: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest on searched group parameters: W [out, in] -> (q, zeros, scales) for `pack_awq`."""
    return round_to_groups(w, *search_group_params(w, gram, group_size), group_size)
