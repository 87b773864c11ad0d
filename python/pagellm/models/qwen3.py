"""Qwen3: Llama blocks plus a per-head RMSNorm on q and k (before rope); no q/k/v bias by default."""

from __future__ import annotations

from pagellm.models.llama import LlamaAttention, LlamaDecoderLayer
from pagellm.models.qwen2 import Qwen2ForCausalLM
from pagellm.models.registry import register_model


class Qwen3Attention(LlamaAttention):
    qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(Qwen2ForCausalLM):
    layer_cls = Qwen3DecoderLayer
