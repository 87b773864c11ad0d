"""The MLA attention module of DeepSeek-V2/V3 (HF parameter names), computing via attention/mla.py.

Projections (as transformers' DeepseekV2Attention / DeepseekV3Attention):

    q        = q_proj(x)                                   (q_lora_rank None)
             = q_b_proj(q_a_layernorm(q_a_proj(x)))        (q_lora_rank set)     [T, H * (d_nope + d_rope)]
    c, k_pe  = kv_a_proj_with_mqa(x)                       [T, kv_lora_rank + d_rope]
    latent   = [kv_a_layernorm(c) | rope(k_pe)]            the cached row, [T, L]
    out      = o_proj(attention)                           [T, H * d_v] -> [T, hidden]

Tensor parallelism: the heads split (q_proj / q_b_proj and kv_b_proj column-parallel, whose rows are whole
heads; o_proj row-parallel); q_a_proj, kv_a_proj_with_mqa and the norms are replicated, so every rank
computes and caches the same latent rows (the latent cache is replicated, not split).

Rope: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (GPT-J style). transformers' V3 with
`rope_interleave` de-interleaves q_pe and k_pe alike while rotating, which permutes both the same way and
leaves every q . k unchanged; rotating in place in the interleaved layout gives the same attention.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.mla import MLALayerSpec, mla_forward
from pagellm.distributed import get_tp_size
from pagellm.distributed.sharding import divide
from pagellm.layers.linear import Linear
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import get_rope, rope_parameters_from_config, yarn_get_mscale


def mla_softmax_scale(config, rope_parameters: dict) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for a scaled rope (transformers' yarn_apply_mscale)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    if rope_parameters.get("rope_type", "default") != "default" and rope_parameters.get("mscale_all_dim"):
        mscale = yarn_get_mscale(rope_parameters["factor"], rope_parameters["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


class MultiHeadLatentAttention(nn.Module):
    """forward(positions [T], hidden [T, hidden_size], ctx) -> [T, hidden_size]; the cache is
    `ctx.kv_caches[layer_idx]` (a LatentKVCache) and the batch `ctx.attn_backend.metadata`."""

    def __init__(self, config, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        self.num_heads = divide(total_heads, get_tp_size(), "num_attention_heads")  # this rank's heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, total_heads * qk_head_dim, dtype=dtype, tp_mode="column")
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias, dtype=dtype)
            # transformers builds q_a_layernorm and kv_a_layernorm with the default eps 1e-6, not rms_norm_eps
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=1e-6, dtype=dtype)
            self.q_b_proj = Linear(self.q_lora_rank, total_heads * qk_head_dim, dtype=dtype, tp_mode="column")
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6, dtype=dtype)
        self.kv_b_proj = Linear(self.kv_lora_rank, total_heads * (self.qk_nope_head_dim + config.v_head_dim),
                                dtype=dtype, tp_mode="column")
        self.o_proj = Linear(total_heads * config.v_head_dim, hidden, bias=bias, dtype=dtype, tp_mode="row")
        rope_parameters = rope_parameters_from_config(config)
        interleaved = bool(getattr(config, "rope_interleave", True))
        self.rotary_emb = get_rope(self.qk_rope_head_dim, self.qk_rope_head_dim,
                                   int(getattr(config, "max_position_embeddings", 0) or 8192), rope_parameters,
                                   is_neox_style=not interleaved, dtype=dtype)
        self.spec = MLALayerSpec(layer_idx, self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim,
                                 config.v_head_dim, self.kv_lora_rank, mla_softmax_scale(config, rope_parameters))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx) -> torch.Tensor:
        T = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(T, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope = q[..., : self.qk_nope_head_dim]
        q_pe = q[..., self.qk_nope_head_dim :].contiguous()
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.contiguous()
        self.rotary_emb(positions, q_pe, k_pe)  # in place
        latent = torch.cat([self.kv_a_layernorm(c_kv.contiguous()), k_pe], dim=-1)
        out = mla_forward(self.spec, q_nope, q_pe, latent, self.kv_b_proj.weight,
                          ctx.kv_caches[self.spec.layer_idx], ctx.attn_backend.metadata)
        return self.o_proj(out.reshape(T, -1))

    def extra_repr(self) -> str:
        return repr(self.spec)
