"""Weight formats: `QuantizationConfig` + `LinearMethodBase` (the seam), the unquantized default, the registry."""

from pagellm.quantization.base import (
    EmbeddingMethodBase, LinearMethodBase, OutputShard, QuantizationConfig, ShardLoader, load_output_slice, new_linear_param,
    set_weight_attrs,
)
from pagellm.quantization.registry import (
    get_quantization_config_cls, list_quantization_methods, register_quantization_config,
)
from pagellm.quantization.unquantized import UnquantizedEmbeddingMethod, UnquantizedLinearMethod
from pagellm.quantization.int8 import Int8Config, Int8LinearMethod  # registers "int8"
from pagellm.quantization.gguf import GGUF_METHOD, GGUFConfig, GGUFEmbeddingMethod, GGUFLinearMethod  # registers "gguf"
from pagellm.quantization.awq import AWQ_METHOD, AWQConfig, AWQLinearMethod  # registers "awq"

__all__ = [
    "AWQ_METHOD", "AWQConfig", "AWQLinearMethod", "EmbeddingMethodBase", "GGUF_METHOD", "GGUFConfig", "GGUFEmbeddingMethod", "GGUFLinearMethod", "UnquantizedEmbeddingMethod", "LinearMethodBase", "OutputShard", "QuantizationConfig", "ShardLoader", "UnquantizedLinearMethod",
    "Int8Config", "Int8LinearMethod", "get_quantization_config_cls", "list_quantization_methods", "load_output_slice", "new_linear_param",
    "register_quantization_config", "set_weight_attrs",
]
