"""Linear layers whose parameters know how to load themselves.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies a
checkpoint tensor into the preallocated parameter (shape-checked). Merged layers (QKV, gate/up)
load each HF tensor into its slice of the merged weight, selected by `shard_id`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:
    import pagellm.ops as _compiled

    _SMALL_M_OK = _compiled.ops_available()[0]
    _linear_small_m = torch.ops.pagellm.linear_small_m.default if _SMALL_M_OK else None
    _AMX_OK = _SMALL_M_OK and _compiled.amx_available()
    _linear_amx = torch.ops.pagellm.linear_amx.default if _AMX_OK else None
except Exception:  # pragma: no cover - depends on the build
    _SMALL_M_OK = _AMX_OK = False

# Which kernel a bf16 CPU linear of M (flattened) rows runs; csrc/ops/linear/linear_choice.h has the
# same rule for the fused decode layer (keep them in sync). Measured on the AMX dev machine:
#   - torch.ops.pagellm.linear_small_m streams the weight once (AVX512-BF16): ~2-3x F.linear at M = 1-2,
#     and the best choice up to M = 4 on a CPU without AMX;
#   - torch.ops.pagellm.linear_amx (AMX tiles) wins from M = 3 to 64, 1.2-2x oneDNN's bf16 GEMM, 1.1-1.4x
#     at 128-256 on the wide shapes (gate/up, the LM head) and about even on the others;
#   - beyond that (prefill chunks) torch's GEMM (oneDNN) is as fast or faster.
SMALL_M_MAX = 2 if _AMX_OK else 4
AMX_MAX_M = 256 if _AMX_OK else 0
_OWN_MAX_M = max(SMALL_M_MAX, AMX_MAX_M)  # rows up to this go to one of pagellm's kernels


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except bf16 CPU inputs with few rows go through pagellm's own kernels (see above).

    fp32 (and every other case) is exactly F.linear, so fp32 results stay bit-identical to HF.
    """
    # Checked cheapest first: this runs ~4 times per layer per decode step.
    if (
        _SMALL_M_OK
        and x.dtype is torch.bfloat16
        and weight.dtype is torch.bfloat16
        and x.is_cpu
        and weight.is_cpu
        and x.dim() >= 1
        and (bias is None or bias.dtype is torch.bfloat16)
    ):
        k = x.shape[-1]
        m = x.numel() // k if k else 0
        no_grad = not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad)  # op has no autograd
        if 0 < m <= _OWN_MAX_M and no_grad:
            op = _linear_small_m if m <= SMALL_M_MAX else _linear_amx
            n = weight.shape[0]
            if x.dim() == 2:  # the decode case; every torch call costs microseconds here
                out = torch.empty((m, n), dtype=x.dtype)
                op(out, x, weight, bias)
                return out
            out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype)
            op(out.view(m, n), x.reshape(m, k), weight, bias)
            return out
    return F.linear(x, weight, bias)


class WeightShapeError(ValueError):
    """A checkpoint tensor's shape does not match the parameter (or shard) it loads into."""


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Copy `loaded_weight` into `param` (dtype-converting), after checking the shape."""
    if shard_id is not None:
        raise ValueError(f"parameter does not take shards (got shard_id={shard_id!r})")
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise WeightShapeError(f"shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded_weight.shape)}")
    with torch.no_grad():
        param.data.copy_(loaded_weight)


def _param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b), HF `nn.Linear` layout: weight [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _param((out_features, in_features), dtype, device)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param((out_features,), dtype, device)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several HF linears with the same input stacked along the output dim (e.g. gate_proj + up_proj).

    `shard_sizes[i]` output rows belong to shard `shard_ids[i]` (shard ids default to 0, 1, ...).
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype | None = None, device=None, shard_ids: list | None = None) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias, dtype=dtype, device=device)
        ids = list(range(len(shard_sizes))) if shard_ids is None else list(shard_ids)
        if len(ids) != len(shard_sizes):
            raise ValueError("shard_ids and shard_sizes differ in length")
        self.shard_sizes = list(shard_sizes)
        self.shard_offsets: dict = {}
        off = 0
        for sid, size in zip(ids, shard_sizes):
            self.shard_offsets[sid] = (off, size)
            off += size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # an already-merged checkpoint tensor
            default_weight_loader(param, loaded_weight)
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_offsets)}")
        off, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, off, size)
        if tuple(target.shape) != tuple(loaded_weight.shape):
            raise WeightShapeError(
                f"shape mismatch for shard {shard_id!r}: expected {tuple(target.shape)}, got {tuple(loaded_weight.shape)}"
            )
        with torch.no_grad():
            target.copy_(loaded_weight)


class QKVLinear(MergedLinear):
    """q_proj, k_proj, v_proj merged: output rows [q (num_heads*head_dim) | k | v (num_kv_heads*head_dim)]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype | None = None, device=None) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=bias, dtype=dtype,
                         device=device, shard_ids=["q", "k", "v"])

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
