"""Pure-torch reference of `lora_apply`: the batched multi-adapter LoRA term (Punica / S-LoRA "shrink then
expand", tokens gathered by adapter slot). Re-exported by `pagellm.ops.reference`.

    for every token t with slot s = token_slots[t] >= 0:
        y[t] += scales[s] * lora_b[s] @ (lora_a[s] @ x[t])

Adapters of a smaller rank than r_max are zero-padded in A's rows and B's columns, so padding adds 0.
"""

from __future__ import annotations

import torch


def lora_apply(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               scales: torch.Tensor, token_slots: torch.Tensor) -> None:
    """y [T, N] (updated in place) += per-token LoRA term of x [T, K].

    lora_a [S, R, K] and lora_b [S, N, R] in x's dtype (S adapter slots, R = max rank), scales float32 [S],
    token_slots int32 [T] in [-1, S) (-1: no adapter). Products accumulate in float32, and the term is added
    to y in float32 before rounding back to y's dtype (as the CPU and CUDA kernels do)."""
    slots = token_slots.to(torch.int64)
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = torch.nonzero(slots == s).flatten()
        xs = x.index_select(0, rows).float()
        shrunk = xs @ lora_a[s].float().t()               # [t_s, R]
        term = (shrunk @ lora_b[s].float().t()) * scales[s].float()  # [t_s, N]
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + term).to(y.dtype))
