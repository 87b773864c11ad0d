"""Mixtral: Mistral blocks whose MLP is a sparse mixture of experts (softmax top-k, renormalized)."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.layers.linear import Linear
from pagellm.layers.moe import FusedMoE, check_routing, moe_activation_for, select_experts
from pagellm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagellm.models.registry import register_model


def check_mixtral_config(config) -> None:
    """ValueError naming the field for what the MoE layers cannot run, before anything is allocated."""
    check_routing(config.num_local_experts, config.num_experts_per_tok, num_experts_field="num_local_experts")
    moe_activation_for(config.hidden_act)


class MixtralSparseMoe(nn.Module):
    """router `gate` [E, H] -> softmax top-k, renormalized -> `experts` (FusedMoE)."""

    def __init__(self, config, dtype: torch.dtype, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        # Mixtral checkpoints name this block `block_sparse_moe` (see MixtralDecoderLayer)
        prefix = prefix.removesuffix(".mlp") + ".block_sparse_moe"
        self.top_k = config.num_experts_per_tok
        # the router stays in the model dtype whatever the weight format (routing is sensitive to it)
        self.gate = Linear(config.hidden_size, config.num_local_experts, bias=False, dtype=dtype,
                           prefix=f"{prefix}.gate")
        self.experts = FusedMoE(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                activation=moe_activation_for(config.hidden_act), dtype=dtype,
                                quant_config=quant_config, prefix=f"{prefix}.experts",
                                intermediate_size_field="intermediate_size")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> [T, H]."""
        topk_weights, topk_ids = select_experts(self.gate(hidden), self.top_k, renormalize=True)
        return self.experts(hidden, topk_weights, topk_ids)


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_cls = MixtralSparseMoe

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # registered under HF's name so parameter names match the checkpoint; `mlp` stays the forward's name
        self.block_sparse_moe = self._modules.pop("mlp")

    @property
    def mlp(self) -> MixtralSparseMoe:
        return self.block_sparse_moe


@register_model("MixtralForCausalLM")
class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer
    expert_params_mapping = {"w1": "gate", "w3": "up", "w2": "down"}

    def __init__(self, config, dtype: torch.dtype = torch.float32, quant_config=None) -> None:
        check_mixtral_config(config)
        super().__init__(config, dtype, quant_config=quant_config)
