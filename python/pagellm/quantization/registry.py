"""Quantization method name -> QuantizationConfig class: the plug point for weight formats.

    from pagellm.quantization import QuantizationConfig, register_quantization_config

    @register_quantization_config("my_int8")
    class MyInt8Config(QuantizationConfig): ...

    LLM(model, quantization="my_int8")   # or a checkpoint whose quantization_config.quant_method is "my_int8"

None (no registered name) means unquantized: `UnquantizedLinearMethod`.
"""

from __future__ import annotations

from typing import Callable

from pagellm.quantization.base import QuantizationConfig

_CONFIGS: dict[str, type[QuantizationConfig]] = {}


def register_quantization_config(name: str) -> Callable[[type[QuantizationConfig]], type[QuantizationConfig]]:
    """Class decorator registering a QuantizationConfig under `name`; another class under a taken name
    is refused (re-registering the same class is a no-op)."""
    if not isinstance(name, str) or not name:
        raise ValueError("quantization method name must be a non-empty string")

    def wrap(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
        if not (isinstance(cls, type) and issubclass(cls, QuantizationConfig)):
            raise TypeError(f"{cls!r} must subclass QuantizationConfig")
        if _CONFIGS.get(name, cls) is not cls:
            raise ValueError(f"quantization method {name!r} is already registered by {_CONFIGS[name].__name__}")
        _CONFIGS[name] = cls
        return cls

    return wrap


def list_quantization_methods() -> list[str]:
    return sorted(_CONFIGS)


def get_quantization_config_cls(name: str) -> type[QuantizationConfig]:
    if name not in _CONFIGS:
        raise ValueError(f"unknown quantization method {name!r}; registered: {list_quantization_methods()} "
                         "(None = unquantized)")
    return _CONFIGS[name]
