"""Pure-torch reference of `torch.ops.pagellm.fused_moe`: the routed experts of a mixture-of-experts MLP.

The contract the CPU / CUDA kernels are tested against, and what `layers/moe.py` runs when the
compiled op is missing. Routing (which experts, with which weights) is decided before this op by
`layers.moe.select_experts`; this op only computes the experts and combines them.

    hidden:       [T, H]        float32 / bfloat16 / float16
    w13:          [E, 2*I, H]   same dtype; rows [0, I) are the gate projection, rows [I, 2I) the up projection
    w2:           [E, H, I]     same dtype; the down projection
    topk_weights: [T, k]        float32; the combine weight of each chosen expert
    topk_ids:     [T, k]        int32 in [0, E); the chosen experts (distinct within a row)
    activation:   "silu" (act(gate) * up, SwiGLU) or "gelu_tanh" (GeGLU, tanh approximation)
    returns:      [T, H]        hidden's dtype

    out[t] = sum_j topk_weights[t, j] * w2[e] @ (act(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)),  e = topk_ids[t, j]

Math is fp32 over the inputs' values; the sum over the k experts is accumulated in fp32 and rounded
once into hidden's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MOE_ACTIVATIONS = ("silu", "gelu_tanh")


def moe_activation(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    raise ValueError(f"unsupported MoE activation {activation!r}; supported: {', '.join(MOE_ACTIVATIONS)}")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """out [T, H]: the weighted sum of each token's chosen experts (see the module docstring)."""
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    x = hidden.float()
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    for e in range(num_experts):
        rows, slots = torch.nonzero(ids == e, as_tuple=True)  # tokens that chose expert e, and in which slot
        if rows.numel() == 0:
            continue
        gate_up = x[rows] @ w13[e].float().t()
        act = moe_activation(gate_up[:, :inter], activation) * gate_up[:, inter:]
        y = act @ w2[e].float().t()
        out.index_add_(0, rows, y * topk_weights[rows, slots].float().unsqueeze(1))
    return out.to(hidden.dtype)
