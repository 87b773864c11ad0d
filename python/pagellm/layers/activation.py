"""Gated activations on a merged [..., 2*d] gate|up tensor: act(gate) * up."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.layers._ops import ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
        ops.silu_and_mul(out, x)  # the kernel takes strided rows
        return out


class GeluAndMul(nn.Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"unknown gelu approximation {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
        ops.gelu_and_mul(out, x, self.approximate)
        return out


_ACTS = {
    "silu": lambda: SiluAndMul(),
    "swish": lambda: SiluAndMul(),
    "gelu": lambda: GeluAndMul("none"),
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
}


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation module for an HF `hidden_act` name."""
    if hidden_act not in _ACTS:
        raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: {sorted(_ACTS)}")
    return _ACTS[hidden_act]()
