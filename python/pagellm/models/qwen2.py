"""Qwen2: Llama blocks with q/k/v bias (o_proj without); sliding window only when use_sliding_window."""

from __future__ import annotations

from pagellm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, layer_window_size
from pagellm.models.registry import register_model


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def qkv_bias(config) -> bool:
        return True

    @staticmethod
    def o_bias(config) -> bool:
        return False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer

    @staticmethod
    def window_size_for_layer(config, layer_idx: int) -> int:
        if not getattr(config, "use_sliding_window", False):
            return -1
        return layer_window_size(config, layer_idx)
