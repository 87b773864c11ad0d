"""Qwen3-MoE: Qwen3 blocks (per-head q/k RMSNorm) with Qwen2-MoE's sparse layers, without the shared expert."""

from __future__ import annotations

from pagellm.models.qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeForCausalLM, Qwen2MoeSparseMoe
from pagellm.models.qwen3 import Qwen3Attention
from pagellm.models.registry import register_model


class Qwen3MoeSparseMoe(Qwen2MoeSparseMoe):
    has_shared_expert = False


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_cls = Qwen3Attention  # bias on q/k/v and o per `attention_bias`, as Llama
    sparse_mlp_cls = Qwen3MoeSparseMoe


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
