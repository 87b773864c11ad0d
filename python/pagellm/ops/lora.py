"""`lora_apply` wrapper: the batched multi-adapter LoRA term (see ops/lora_reference.py for the math)."""

from __future__ import annotations

import torch

from pagellm.ops.arg_checks import _dtype, _float, _ndim, _same, _tensor


def check_lora_apply(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     scales: torch.Tensor, token_slots: torch.Tensor) -> None:
    """TypeError / ValueError naming the argument for anything lora_apply would refuse (slot values included)."""
    for t, n in ((y, "y"), (x, "x"), (lora_a, "lora_a"), (lora_b, "lora_b"), (scales, "scales"),
                 (token_slots, "token_slots")):
        _tensor(t, n)
    _float(x, "x")
    for t, n in ((y, "y"), (lora_a, "lora_a"), (lora_b, "lora_b")):
        _same(t, x, n, "x")
    _dtype(scales, torch.float32, "scales")
    _dtype(token_slots, torch.int32, "token_slots")
    for t, n, d in ((y, "y", 2), (x, "x", 2), (lora_a, "lora_a", 3), (lora_b, "lora_b", 3), (scales, "scales", 1),
                    (token_slots, "token_slots", 1)):
        _ndim(t, d, n)
    T, K = x.shape
    S, R = lora_a.shape[:2]
    N = y.shape[1]
    expect = {"y": (y, (T, N)), "lora_a": (lora_a, (S, R, K)), "lora_b": (lora_b, (S, N, R)),
              "scales": (scales, (S,)), "token_slots": (token_slots, (T,))}
    for name, (t, shape) in expect.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if T and (int(token_slots.min()) < -1 or int(token_slots.max()) >= S):
        raise ValueError(f"token_slots must be in [-1, {S}), got values in "
                         f"[{int(token_slots.min())}, {int(token_slots.max())}]")


def lora_apply(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               scales: torch.Tensor, token_slots: torch.Tensor) -> None:
    """y [T, N] += scales[s] * lora_b[s] @ (lora_a[s] @ x[t]) for each token t with slot s = token_slots[t] >= 0.

    x [T, K]; lora_a [S, R, K], lora_b [S, N, R] in x's dtype (ranks below R zero-padded); scales float32 [S];
    token_slots int32 [T] in [-1, S), -1 = no adapter. fp32 accumulation."""
    check_lora_apply(y, x, lora_a, lora_b, scales, token_slots)
    torch.ops.pagellm.lora_apply(y, x, lora_a, lora_b, scales, token_slots)
