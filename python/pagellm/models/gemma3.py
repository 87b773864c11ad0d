"""Gemma 3 (text): Gemma 2's blocks plus per-head q/k GemmaRMSNorm and rope per layer type.

As transformers' Gemma3ForCausalLM (Gemma3TextConfig):
- sliding layers rotate with `rope_parameters["sliding_attention"]` (the local base frequency, 10k), global
  layers with `rope_parameters["full_attention"]` (1M, possibly scaled); transformers 5.x stores one dict per
  layer type, older flat configs give `rope_local_base_freq` for the sliding layers;
- attention logits are not soft-capped (HF's Gemma 3 attention ignores attn_logit_softcapping);
- final_logit_softcapping as Gemma 2 (null by default).

Gemma3ForConditionalGeneration checkpoints (image + text) keep the text weights under
`model.language_model.*` (transformers 5.x; `language_model.model.*` before) and are not loaded here.
"""

from __future__ import annotations

import torch

from pagellm.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, LAYER_TYPES, checked_rope
from pagellm.models.registry import register_model


class _LayerTypeRopeConfig:
    """The fields get_rope_from_config reads, with one layer type's rope parameters."""

    def __init__(self, config, rope_parameters: dict) -> None:
        self.rope_parameters = rope_parameters
        self.rope_scaling = None
        self.rope_theta = rope_parameters.get("rope_theta")
        self.max_position_embeddings = config.max_position_embeddings
        self.partial_rotary_factor = getattr(config, "partial_rotary_factor", None)


def layer_type_rope_parameters(config, layer_type: str) -> tuple[dict, str]:
    """(rope parameters of `layer_type`, the config field they come from)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and set(params) <= set(LAYER_TYPES) and params:
        if not isinstance(params.get(layer_type), dict):
            raise ValueError(f"config.rope_parameters has no dict for layer type {layer_type!r}: {params!r}")
        return dict(params[layer_type]), f"rope_parameters[{layer_type!r}]"
    if layer_type == "full_attention":
        return None, "rope_parameters"  # flat (pre-5.x) config: the global layers read it as any model does
    base = getattr(config, "rope_local_base_freq", None) or 10000.0
    return {"rope_type": "default", "rope_theta": float(base)}, "rope_local_base_freq"


class Gemma3Attention(Gemma2Attention):
    qk_norm = True

    def make_rope(self, config, layer_idx: int, dtype: torch.dtype):
        layer_type = config.layer_types[layer_idx]
        params, field = layer_type_rope_parameters(config, layer_type)
        view = config if params is None else _LayerTypeRopeConfig(config, params)
        return checked_rope(view, self.head_dim, dtype, field)

    @staticmethod
    def attn_softcap(config) -> float:
        return 0.0


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


@register_model("Gemma3ForCausalLM")
class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer

    def __init__(self, config, dtype: torch.dtype = torch.float32, quant_config=None) -> None:
        if not getattr(config, "layer_types", None):
            raise ValueError("config.layer_types is missing: Gemma 3 needs one entry per layer "
                             f"(one of {list(LAYER_TYPES)})")
        super().__init__(config, dtype, quant_config=quant_config)
