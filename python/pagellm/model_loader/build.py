"""Construct a registered model for a ModelFiles and load its weights."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pagellm.model_loader.files import CONFIG_NAME, ModelFiles, iter_weights_with_file
from pagellm.models.base import WeightLoadError
from pagellm.models.registry import get_model_cls

_ALLOWED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def resolve_dtype(dtype: torch.dtype | str | None, hf_config=None) -> torch.dtype:
    """"auto"/None -> config's dtype (torch_dtype) if float32/bfloat16/float16, else float32."""
    if dtype is None or dtype == "auto":
        cfg = None
        if hf_config is not None:
            cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(cfg, torch.dtype):
            cfg = str(cfg).removeprefix("torch.")
        return _ALLOWED.get(_ALIASES.get(str(cfg), str(cfg)), torch.float32)
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = _ALIASES.get(str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch."))
    if name not in _ALLOWED:
        raise ValueError(f"unsupported dtype {dtype!r}; allowed: auto, {', '.join(_ALLOWED)}")
    return _ALLOWED[name]


def build_model(files: ModelFiles, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu") -> nn.Module:
    """Registry lookup by config.architectures[0], construct on `device` in `dtype`, load weights, eval()."""
    config = files.hf_config
    cfg_file = Path(files.path) / CONFIG_NAME
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError(f"{cfg_file}: no 'architectures' entry; cannot pick a model class")
    try:
        cls = get_model_cls(archs[0])
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from None
    torch_dtype = resolve_dtype(dtype, config)
    with torch.device(device):
        model = cls(config, torch_dtype)

    where: dict[str, Path] = {}

    def weights():
        for f, name, tensor in iter_weights_with_file(files):
            where["file"] = f
            yield name, tensor

    try:
        loaded = model.load_weights(weights())
    except WeightLoadError as e:
        raise WeightLoadError(e.tensor_name, e.message, file=str(where.get("file", files.path))) from None
    missing = sorted(model.expected_weight_names() - loaded)
    if missing:
        more = f" (and {len(missing) - 1} more: {missing[1:6]}...)" if len(missing) > 1 else ""
        raise WeightLoadError(missing[0], f"missing tensor{more}", file=str(files.path))
    return model.eval()
