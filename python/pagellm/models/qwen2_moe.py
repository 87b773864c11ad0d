"""Qwen2-MoE: Qwen2 blocks (q/k/v bias per `qkv_bias`) whose MLP is, on the sparse layers, a softmax top-k mixture
of experts (renormalized when `norm_topk_prob`) plus a shared expert scaled by sigmoid(`shared_expert_gate`).

Sparse layers: `num_experts` > 0, layer not in `mlp_only_layers`, and (layer + 1) % `decoder_sparse_step` == 0;
the others keep a dense MLP of `intermediate_size`.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed import get_tp_size
from pagellm.distributed.communication import tensor_model_parallel_all_reduce
from pagellm.distributed.parallel_linear import row_parallel_partial
from pagellm.layers.activation import get_act_and_mul
from pagellm.layers.linear import Linear, MergedLinear
from pagellm.layers.moe import FusedMoE, check_routing, moe_activation_for, select_experts
from pagellm.models.llama import LlamaDecoderLayer, LlamaMLP
from pagellm.models.qwen2 import Qwen2Attention, Qwen2ForCausalLM
from pagellm.models.registry import register_model


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has the MoE block (transformers' rule)."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


def check_qwen_moe_config(config) -> None:
    """ValueError naming the field for what the MoE layers cannot run, before anything is allocated."""
    step = getattr(config, "decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step={step!r} must be an integer >= 1")
    if any(is_sparse_layer(config, i) for i in range(config.num_hidden_layers)):
        check_routing(config.num_experts, config.num_experts_per_tok, num_experts_field="num_experts")
        moe_activation_for(config.hidden_act)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) of a given width, HF names gate_proj / up_proj / down_proj (a shared expert).
    Under tensor parallelism gate/up are column-parallel and down row-parallel, as the routed experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, dtype: torch.dtype,
                 quant_config=None, prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], dtype=dtype,
                                         quant_config=quant_config, prefix=f"{prefix}.gate_up_proj", tp_mode="column")
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype, quant_config=quant_config,
                                prefix=f"{prefix}.down_proj", tp_mode="row")
        self.act_fn = get_act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output under tensor parallelism (not yet summed over the ranks)."""
        return row_parallel_partial(self.down_proj, self.act_fn(self.gate_up_proj(x)))


class Qwen2MoeSparseMoe(nn.Module):
    """router `gate` [E, H] -> softmax top-k (renormalized if norm_topk_prob) -> `experts`, plus the shared expert."""

    has_shared_expert = True

    def __init__(self, config, dtype: torch.dtype, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = bool(config.norm_topk_prob)
        # routers stay in the model dtype whatever the weight format (routing is sensitive to it)
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False, dtype=dtype, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                activation=moe_activation_for(config.hidden_act), dtype=dtype,
                                quant_config=quant_config, prefix=f"{prefix}.experts",
                                reduce_results=not self.has_shared_expert)
        if self.has_shared_expert:
            self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                          config.hidden_act, dtype, quant_config=quant_config,
                                          prefix=f"{prefix}.shared_expert")
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False, dtype=dtype,
                                             prefix=f"{prefix}.shared_expert_gate")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> [T, H]."""
        topk_weights, topk_ids = select_experts(self.gate(hidden), self.top_k, renormalize=self.renormalize)
        out = self.experts(hidden, topk_weights, topk_ids)
        if self.has_shared_expert:
            # the routed and shared experts' partial sums (per-token gate: it scales each rank's part alike),
            # then one all-reduce for both under tensor parallelism
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert.forward_partial(hidden)
            if get_tp_size() > 1:
                out = tensor_model_parallel_all_reduce(out)
        return out


class Qwen2MoeAttention(Qwen2Attention):
    @staticmethod
    def qkv_bias(config) -> bool:
        return bool(getattr(config, "qkv_bias", True))


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2MoeAttention
    sparse_mlp_cls = Qwen2MoeSparseMoe

    def mlp_cls(self, config, dtype: torch.dtype, quant_config=None, prefix: str = "") -> nn.Module:
        # called by LlamaDecoderLayer.__init__ after self_attn is built, which knows the layer index
        if is_sparse_layer(config, self.self_attn.attn.spec.layer_idx):
            return self.sparse_mlp_cls(config, dtype, quant_config=quant_config, prefix=prefix)
        return LlamaMLP(config, dtype, quant_config=quant_config, prefix=prefix)


@register_model("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    layer_cls = Qwen2MoeDecoderLayer
    expert_params_mapping = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, config, dtype: torch.dtype = torch.float32, quant_config=None) -> None:
        check_qwen_moe_config(config)
        super().__init__(config, dtype, quant_config=quant_config)
