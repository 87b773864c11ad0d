"""Model building blocks: linear layers with weight loaders, norms, rope, activations, embeddings, attention."""

from pagellm.layers.activation import GeluAndMul, SiluAndMul, get_act_and_mul
from pagellm.layers.attention import Attention
from pagellm.layers.embedding import LMHead, VocabEmbedding
from pagellm.layers.linear import Linear, MergedLinear, QKVLinear, WeightShapeError, default_weight_loader
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryEmbedding, get_rope, get_rope_from_config, rope_parameters_from_config

__all__ = [
    "Attention", "GeluAndMul", "LMHead", "Linear", "MergedLinear", "QKVLinear", "RMSNorm", "RotaryEmbedding",
    "SiluAndMul", "VocabEmbedding", "WeightShapeError", "default_weight_loader", "get_act_and_mul", "get_rope",
    "get_rope_from_config", "rope_parameters_from_config",
]
