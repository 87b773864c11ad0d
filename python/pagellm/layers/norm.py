"""RMSNorm over the last dim, HF numerics (fp32 statistics, cast back, then * weight)."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.layers._ops import ops
from pagellm.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: returns rmsnorm(x) * w (a new tensor).

        With `residual`: in place, residual += x and x = rmsnorm(residual) * w; returns (x, residual).
        """
        if residual is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            ops.rms_norm(out, x, self.weight, self.eps)
            return out
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


def gemma_norm_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Gemma checkpoints store w of x * (1 + w); the parameter holds 1 + w (summed in fp32, as HF does), so
    loading again in place (weight updates) stays right."""
    default_weight_loader(param, loaded_weight.float() + 1.0, shard_id)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, rmsnorm(x) * (1 + w), on the same ops: `weight` holds 1 + w (its loader adds the 1).

    Equal to transformers in float32. In half precision HF rounds once, (x_fp32 * (1 + w)).to(dtype); the
    ops round the normalized x, then the product (one extra rounding), and 1 + w is stored in the model dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__(hidden_size, eps=eps, dtype=dtype, device=device)
        self.weight.weight_loader = gemma_norm_weight_loader
