"""Model definitions (HF-compatible parameter names) and the architecture registry."""

from pagellm.models.base import CausalLMBase, WeightLoadError
from pagellm.forward_context import ForwardContext
from pagellm.models.registry import get_model_cls, list_models, register_model

__all__ = ["CausalLMBase", "ForwardContext", "WeightLoadError", "get_model_cls", "list_models", "register_model"]
