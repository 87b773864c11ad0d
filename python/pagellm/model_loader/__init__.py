"""Finding and loading models: HF safetensors directories, GGUF files (converted once), the default model."""

from pagellm.model_loader.build import build_model, resolve_dtype, resolve_quant_config
from pagellm.model_loader.default_model import DEFAULT_MODEL_NAME, default_model_gguf_path
from pagellm.model_loader.files import ModelFiles, iter_weights, open_model
from pagellm.model_loader.gguf_convert import cache_dir, gguf_to_hf_dir

__all__ = [
    "DEFAULT_MODEL_NAME", "ModelFiles", "build_model", "cache_dir", "default_model_gguf_path", "gguf_to_hf_dir",
    "iter_weights", "open_model", "resolve_dtype", "resolve_quant_config",
]
