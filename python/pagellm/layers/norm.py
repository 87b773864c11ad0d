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
