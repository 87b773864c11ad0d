"""A norm or an activation folded into the next linear's CUDA GEMV (ops/fused_dispatch.py): the producer hands the
Linear a `FoldedRows` (what its input would be, not yet computed) and `Linear.forward` computes that input in the
prologue of its own kernel: one launch instead of two in a decode step. Only where the consumer is a plain Linear
whose product runs `linear_gemv` (`folds_into`); everywhere else (the CPU, quantized weights, tensor parallelism,
LoRA hooks, more rows than the GEMV takes) the producers compute their output as before."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.layers.activation import SiluAndMul
from pagellm.ops import fused_dispatch, linear_dispatch
from pagellm.quantization.unquantized import UnquantizedLinearMethod

_OP = torch.ops.pagellm


def folds_into(linear: nn.Module | None, x: torch.Tensor, enabled: bool) -> bool:
    """Whether `linear` (a Linear, or None) can take its input x folded: the fusion `enabled`, an unquantized weight
    without tensor parallelism or hooks, and a product `linear_dispatch` sends to linear_gemv's kernels 2-4."""
    return (
        enabled
        and x.is_cuda
        and linear is not None
        and type(getattr(linear, "linear_method", None)) is UnquantizedLinearMethod
        and linear.tp_plan is None
        and not linear._forward_hooks
        and not linear._forward_pre_hooks
        and linear_dispatch.CUDA_GEMV_KERNEL != 1
        and linear_dispatch.cuda_gemv_takes(x, linear.weight, linear.bias)
    )


class FoldedRows:
    """The input rows [M, K] of one Linear, not yet computed. `Linear.forward` calls `linear(weight, bias)`; any
    other consumer must call `materialize()` (which computes them with the unfused op)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def materialize(self) -> torch.Tensor:
        raise NotImplementedError


class FoldedNorm(FoldedRows):
    """rms_norm(x [+ residual]) * weight. With a residual, `residual_out` (a new tensor) receives x + residual when
    the rows are computed, as fused_add_rms_norm leaves it in `residual` (x and residual are not modified)."""

    def __init__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> None:
        self.x, self.residual, self.weight, self.eps = x, residual, weight, eps
        self.residual_out = None if residual is None else torch.empty_like(residual)
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty((self.x.shape[0], weight.shape[0]), dtype=self.dtype, device=self.device)
        _OP.rms_norm_linear.default(out, self.residual_out, self.x, self.residual, self.weight, self.eps, weight, bias,
                                    linear_dispatch.CUDA_GEMV_KERNEL, linear_dispatch.CUDA_GEMV_PDL)
        return out

    def materialize(self) -> torch.Tensor:
        h = torch.empty_like(self.x)
        if self.residual is None:
            _OP.rms_norm.default(h, self.x, self.weight, self.eps)
        else:
            h.copy_(self.x)
            self.residual_out.copy_(self.residual)
            _OP.fused_add_rms_norm.default(h, self.residual_out, self.weight, self.eps)
        return h


class FoldedSiluMul(FoldedRows):
    """silu(x[:, :K]) * x[:, K:] of the gate | up rows x [M, 2K]."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.shape, self.dtype, self.device = x.shape[:-1] + (x.shape[-1] // 2,), x.dtype, x.device

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty((self.x.shape[0], weight.shape[0]), dtype=self.dtype, device=self.device)
        _OP.silu_and_mul_linear.default(out, self.x, weight, bias, linear_dispatch.CUDA_GEMV_KERNEL,
                                        linear_dispatch.CUDA_GEMV_PDL)
        return out

    def materialize(self) -> torch.Tensor:
        h = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        _OP.silu_and_mul.default(h, self.x)
        return h


def fold_norm(norm, x: torch.Tensor, residual: torch.Tensor | None, into: nn.Module | None):
    """RMSNorm `norm` applied as a decoder layer applies it before `into`: returns (rows, residual), rows folded into
    `into`'s GEMV where `folds_into` allows, else computed now (then residual is updated in place as usual);
    without a residual (the first layer) the residual returned is x."""
    if x.dim() == 2 and folds_into(into, x, fused_dispatch.CUDA_FUSE_NORM_GEMV):
        rows = FoldedNorm(x, residual, norm.weight, norm.eps)
        return rows, (x if residual is None else rows.residual_out)
    if residual is None:
        return norm(x), x
    return norm(x, residual)


def fold_act(act: nn.Module, x: torch.Tensor, into: nn.Module | None):
    """act(x) for the linear `into`: a SiluAndMul folded into its GEMV where `folds_into` allows, else computed."""
    if type(act) is SiluAndMul and x.dim() == 2 and folds_into(into, x, fused_dispatch.CUDA_FUSE_ACT_GEMV):
        return FoldedSiluMul(x)
    return act(x)
