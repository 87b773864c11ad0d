"""Registry of attention backends: the plug point for swapping kernels.

    from pagellm.attention import BaseAttentionBackend, register_attention_backend

    @register_attention_backend("mine")
    class MyBackend(BaseAttentionBackend):
        def forward(self, layer, query, key, value, kv_cache): ...   # kv_cache: PagedKVCache

    LLM(model, attention_backend="mine")     # or PAGELLM_ATTENTION_BACKEND=mine
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from pagellm.attention.base import BaseAttentionBackend
from pagellm.logger import init_logger

logger = init_logger(__name__)

ENV_VAR = "PAGELLM_ATTENTION_BACKEND"
_BACKENDS: dict[str, type[BaseAttentionBackend]] = {}
# Preference order for "auto", per device type.
_AUTO_ORDER = {"cuda": ("cuda", "torch"), "cpu": ("cpu", "torch")}


def register_attention_backend(name: str) -> Callable[[type[BaseAttentionBackend]], type[BaseAttentionBackend]]:
    """Class decorator registering a backend under `name` (replacing any earlier one of that name)."""
    if not isinstance(name, str) or not name:
        raise ValueError("attention backend name must be a non-empty string")

    def wrap(cls: type[BaseAttentionBackend]) -> type[BaseAttentionBackend]:
        if not (isinstance(cls, type) and issubclass(cls, BaseAttentionBackend)):
            raise TypeError(f"{cls!r} must subclass BaseAttentionBackend")
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return wrap


def list_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend_cls(name: str) -> type[BaseAttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; registered: {list_attention_backends()}")
    return _BACKENDS[name]


def select_attention_backend(requested: str | None, device: torch.device) -> BaseAttentionBackend:
    """Pick and construct a backend: env var > `requested` > auto; falls back with a logged reason."""
    device = torch.device(device)
    choice = os.environ.get(ENV_VAR) or requested or "auto"
    if choice == "auto":
        candidates = list(_AUTO_ORDER.get(device.type, ("torch",)))
    else:
        get_attention_backend_cls(choice)  # unknown names are an error, not a silent fallback
        candidates = list(dict.fromkeys([choice, "torch"]))
    for name in candidates:
        cls = _BACKENDS.get(name)
        if cls is None:
            logger.warning("attention backend %r is not registered", name)
            continue
        ok, why = cls.is_available(device)
        if ok:
            if name != candidates[0]:
                logger.warning("falling back to attention backend %r", name)
            return cls(device)
        logger.warning("attention backend %r unavailable on %s: %s", name, device, why)
    raise RuntimeError(f"no attention backend available on {device}")
