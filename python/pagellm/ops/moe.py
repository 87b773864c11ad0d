"""Validating wrapper of `torch.ops.pagellm.fused_moe` (the routed experts of a mixture-of-experts MLP).
Re-exported by `pagellm.ops`; contract and pure-torch reference: `pagellm.ops.moe_reference`."""

from __future__ import annotations

import torch

from pagellm.ops.arg_checks import _dtype, _float, _ndim, _same, _tensor
from pagellm.ops.moe_reference import MOE_ACTIVATIONS


def _check_moe_shapes(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> None:
    for t, ndim, name in ((hidden, 2, "hidden"), (w13, 3, "w13"), (w2, 3, "w2"), (topk_weights, 2, "topk_weights"),
                          (topk_ids, 2, "topk_ids")):
        _ndim(t, ndim, name)
    (num_tokens, hidden_size), (num_experts, two_inter, w13_in) = hidden.shape, w13.shape
    if two_inter % 2 or w13_in != hidden_size:
        raise ValueError(f"w13 shape {tuple(w13.shape)} must be [E, 2 * I, H = {hidden_size}] (H of hidden)")
    expected_w2 = (num_experts, hidden_size, two_inter // 2)
    if tuple(w2.shape) != expected_w2:
        raise ValueError(f"w2 shape {tuple(w2.shape)} must be [E, H, I] = {expected_w2} (from hidden and w13)")
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids shape {tuple(topk_ids.shape)} must be [T = {num_tokens}, k] (T of hidden)")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids shape "
                         f"{tuple(topk_ids.shape)}")
    if topk_ids.shape[1] > num_experts:
        raise ValueError(f"k = {topk_ids.shape[1]} experts per token is more than the E = {num_experts} experts of w13")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """out [T, H] = sum_j topk_weights[t, j] * w2[e] @ (act(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)), e = topk_ids[t, j].

    hidden [T, H] float32 / bfloat16 / float16; w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] in
    hidden's dtype; topk_weights float32 [T, k]; topk_ids int32 [T, k] in [0, E) (distinct within a row);
    activation "silu" or "gelu_tanh". fp32 math, the k experts summed in fp32, one rounding into hidden's dtype.
    Returns a new tensor. Reads topk_ids to check their range (the op itself does on the CPU; on CUDA it skips
    ids outside [0, E)). Reference: `moe_reference.fused_moe`."""
    _float(hidden, "hidden")
    for t, name in ((w13, "w13"), (w2, "w2")):
        _tensor(t, name)
        _same(t, hidden, name, "hidden")
    _dtype(topk_weights, torch.float32, "topk_weights")
    _dtype(topk_ids, torch.int32, "topk_ids")
    for t, name in ((topk_weights, "topk_weights"), (topk_ids, "topk_ids")):
        if t.device != hidden.device:
            raise ValueError(f"{name} must be on the device of hidden ({hidden.device}), got {t.device}")
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(MOE_ACTIVATIONS)}, got {activation!r}")
    _check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids)
    if topk_ids.numel() and not bool(((topk_ids >= 0) & (topk_ids < w13.shape[0])).all()):
        bad = topk_ids[(topk_ids < 0) | (topk_ids >= w13.shape[0])][0].item()
        raise ValueError(f"topk_ids must be in [0, E = {w13.shape[0]}), got {bad}")
    return torch.ops.pagellm.fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation)
