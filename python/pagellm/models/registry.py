"""Architecture name (HF `config.architectures[0]`) -> model class.

To add an architecture: write `pagellm/models/<name>.py` with a class decorated by
`@register_model("XForCausalLM")`, and add the module to `_BUILTIN_MODULES` below.
"""

from __future__ import annotations

import importlib
from typing import Callable

from torch import nn

_MODELS: dict[str, type[nn.Module]] = {}

_BUILTIN_MODULES = [
    "pagellm.models.llama",
    "pagellm.models.qwen2",
    "pagellm.models.qwen3",
    "pagellm.models.mixtral",
    "pagellm.models.qwen2_moe",
    "pagellm.models.qwen3_moe",
    "pagellm.models.deepseek_v2",
    "pagellm.models.gemma2",
    "pagellm.models.gemma3",
]
_imported = False


def register_model(*arch_names: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator registering a model class under one or more HF architecture names."""
    if not arch_names or not all(isinstance(a, str) and a for a in arch_names):
        raise ValueError("register_model needs at least one non-empty architecture name")

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        for name in arch_names:
            _MODELS[name] = cls
        return cls

    return wrap


def _import_builtins() -> None:
    global _imported
    if not _imported:
        for mod in _BUILTIN_MODULES:
            importlib.import_module(mod)
        _imported = True


def list_models() -> list[str]:
    _import_builtins()
    return sorted(_MODELS)


def get_model_cls(arch: str) -> type[nn.Module]:
    _import_builtins()
    if arch not in _MODELS:
        raise ValueError(f"unsupported model architecture {arch!r}; supported: {list_models()}")
    return _MODELS[arch]
