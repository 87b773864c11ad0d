"""Pure-torch references of the fused CUDA ops (each is two ops of `pagellm.ops.reference` composed; the CUDA
kernels give the bits of the two CUDA kernels they replace)."""

from __future__ import annotations

import torch

from pagellm.ops import reference as _ref


def rotary_embedding_and_cache(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
    value_cache: torch.Tensor, slot_mapping: torch.Tensor, head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool,
) -> None:  # fmt: skip
    """rotary_embedding (query and key in place), then reshape_and_cache of the rotated key and the value, both
    viewed as [num_tokens, num_kv_heads, head_size]."""
    _ref.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    t = key.shape[0]
    _ref.reshape_and_cache(key_cache, value_cache, key.reshape(t, -1, head_size), value.reshape(t, -1, head_size),
                           slot_mapping)


def rms_norm_linear(
    out: torch.Tensor, residual_out: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None,
    norm_weight: torch.Tensor, epsilon: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
    kernel: int = 4, pdl: bool = False,
) -> None:  # fmt: skip
    """out = linear(rms_norm(x) * norm_weight); with residual: residual_out = x + residual (rounded to x's dtype)
    and the norm is of that sum (fused_add_rms_norm's arithmetic). x and residual are left as they are."""
    if (residual is None) != (residual_out is None):
        raise ValueError("residual and residual_out must be given together (or neither)")
    h = torch.empty_like(x)
    if residual is None:
        _ref.rms_norm(h, x, norm_weight, epsilon)
    else:
        h.copy_(x)
        residual_out.copy_(residual)
        _ref.fused_add_rms_norm(h, residual_out, norm_weight, epsilon)
    _ref.linear_gemv(out, h, weight, bias, kernel, pdl)


def silu_and_mul_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        kernel: int = 4, pdl: bool = False) -> None:
    """out = linear(silu(x[:, :K]) * x[:, K:]) for x [M, 2K] (the gate | up rows) and weight [N, K]."""
    h = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    _ref.silu_and_mul(h, x)
    _ref.linear_gemv(out, h, weight, bias, kernel, pdl)
