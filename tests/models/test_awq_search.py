"""AWQ's searches against AutoAWQ's algorithm as published (auto_scale with duo scaling, auto_clip), each
objective recomputed directly on the activations x [tokens, in] instead of the Gram matrix the searches use."""

from __future__ import annotations

import pytest
import torch

from pagellm.quantization.awq_search import (
    InputStats, activation_scales, apply_clip, pseudo_quantize, search_clip, search_scale, weight_scales,
)

G = 32


def _inputs(tokens: int = 400, in_features: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=g)
    x[:, [5, 40, 77]] *= 25.0  # AWQ's salient channels
    return x


def _stats(x: torch.Tensor) -> InputStats:
    stats = InputStats.empty(x.shape[1])
    stats.add(x)
    return stats


def _direct_scaled_error(x, weights, s):
    return torch.cat([(x / s) @ pseudo_quantize(w * s, G).t() - x @ w.t() for w in weights], 1).pow(2).mean().item()


def test_weight_scales_is_autoawq_w_mean():
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(16, 64, generator=g), torch.randn(8, 64, generator=g)]
    w = torch.cat(weights)
    expected = torch.zeros(64)
    for row in w:  # per (row, group): |w| / (group absmax + 1e-6), then the mean over rows
        for k in range(0, 64, G):
            expected[k:k + G] += row[k:k + G].abs() / (row[k:k + G].abs().max() + 1e-6)
    torch.testing.assert_close(weight_scales(weights, G), expected / w.shape[0])


def test_duo_scales_follow_activation_and_weight_magnitudes():
    mean_abs = torch.tensor([0.5, 1.0, 8.0, 1.0])
    w_mean = torch.tensor([0.5, 0.5, 0.5, 0.1])
    s = activation_scales(mean_abs, 0.5, w_mean)
    assert (s.max() * s.min()).item() == pytest.approx(1.0, rel=1e-5)
    ratio = (mean_abs.pow(0.5) / (w_mean.pow(0.5) + 1e-4))
    torch.testing.assert_close(s / s[0], ratio / ratio[0])  # the normalization is one common factor
    assert torch.equal(activation_scales(mean_abs, 0.0, None), torch.ones(4))  # paper's alpha = 0: RTN


@pytest.mark.parametrize("duo", [True, False])
def test_search_scale_minimizes_the_direct_objective(duo):
    x = _inputs()
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(24, 96, generator=g) * 0.05, torch.randn(40, 96, generator=g) * 0.05]
    s, losses = search_scale(_stats(x), weights, G, num_grid=10, duo_scaling=duo)
    w_mean = weight_scales(weights, G) if duo else None
    candidates = [torch.ones(96)] + [activation_scales(x.abs().mean(0), i / 10, w_mean) for i in range(10)]
    direct = [_direct_scaled_error(x, weights, c) for c in candidates]
    assert losses == pytest.approx(direct, rel=1e-3)
    assert _direct_scaled_error(x, weights, s) == pytest.approx(min(direct), rel=1e-3)
    assert min(direct) < 0.7 * direct[0]  # salient channels: scaling beats RTN clearly


def test_search_clip_is_autoawq_symmetric_clip():
    x = _inputs(seed=3)
    w = torch.randn(12, 96, generator=torch.Generator().manual_seed(4)) * 0.05
    w[:, 3] += 0.4  # one large weight per group 0 row: clipping it can pay off
    clip_min, clip_max = search_clip(_stats(x), w, G, num_grid=20, max_shrink=0.5)
    absmax = w.abs().reshape(12, -1, G).amax(dim=2)
    torch.testing.assert_close(clip_min, -clip_max)
    # brute force per (row, group) on the activations: m = absmax * (1 - i / 20), i < 10, error of x_g . w_g
    best_err = torch.full_like(absmax, float("inf"))
    best_max = absmax.clone()
    for i in range(10):
        m = absmax * (1 - i / 20)
        q = pseudo_quantize(apply_clip(w, -m, m, G), G)
        err = ((x.reshape(-1, 1, 3, G) * (q - w).reshape(1, 12, 3, G)).sum(-1)).pow(2).sum(0)  # [rows, groups]
        better = err < best_err * (1 - 1e-4)
        best_err, best_max = torch.where(better, err, best_err), torch.where(better, m, best_max)
    torch.testing.assert_close(clip_max, best_max)
    assert (clip_max[:, 0] < absmax[:, 0]).any()  # the large weights were clipped somewhere
