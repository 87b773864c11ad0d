"""Construct a registered model for a ModelFiles and load its weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from pagellm.distributed import get_pp_size, get_tp_size
from pagellm.distributed.weight_slices import iter_mmap_weights_with_file
from pagellm.model_loader.files import CONFIG_NAME, ModelFiles, iter_weights_with_file, tensor_headers, weight_files
from pagellm.model_loader.gguf_native import NativeGGUFPlan, plan_native_gguf
from pagellm.model_loader.weight_arena import arena_mode, pack_weights
from pagellm.models.base import WeightLoadError
from pagellm.models.registry import get_model_cls
from pagellm.quantization import (
    GGUF_METHOD, QuantizationConfig, get_quantization_config_cls, list_quantization_methods,
)
from pagellm.quantization.awq import AWQ_METHOD, AWQ_QUANT_CONFIG_FILE

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


def checkpoint_quantization(hf_config, cfg_file: Path | str = CONFIG_NAME) -> tuple[dict | None, str]:
    """(the checkpoint's quantization dict or None, where it came from): config.json's `quantization_config`,
    else AutoAWQ's `quant_config.json` next to config.json (whose quant_method is "awq" when it names none)."""
    hf_quant = getattr(hf_config, "quantization_config", None)
    if hf_quant is not None and not isinstance(hf_quant, dict):
        hf_quant = hf_quant.to_dict() if hasattr(hf_quant, "to_dict") else vars(hf_quant)
    if hf_quant:
        return dict(hf_quant), f"{cfg_file}: quantization_config"
    awq_file = Path(cfg_file).parent / AWQ_QUANT_CONFIG_FILE
    if awq_file.is_file():
        with open(awq_file) as fh:
            raw = json.load(fh)
        if not isinstance(raw, dict):
            raise ValueError(f"{awq_file}: expected a JSON object, got {type(raw).__name__}")
        return {"quant_method": AWQ_METHOD, **raw}, str(awq_file)
    return None, str(cfg_file)


def resolve_quant_config(quantization: str | None, hf_config,
                         cfg_file: Path | str = CONFIG_NAME) -> QuantizationConfig | None:
    """The checkpoint's weight format: `quantization` if named (it must agree with the checkpoint's
    quant_method when that is present), else that quant_method, else None (unquantized).
    A name that is not registered -> ValueError naming it and the registered ones."""
    hf_quant, where = checkpoint_quantization(hf_config, cfg_file)
    ckpt_method = (hf_quant or {}).get("quant_method")
    if quantization is not None and ckpt_method is not None and quantization != ckpt_method:
        raise ValueError(f"quantization={quantization!r}, but the checkpoint is already quantized with "
                         f"quant_method={ckpt_method!r} ({where}); load it with quantization=None or "
                         f"{ckpt_method!r}, or load a float checkpoint to use {quantization!r}")
    name = quantization if quantization is not None else ckpt_method
    if name is None:
        return None
    if name not in list_quantization_methods():
        prefix = "" if quantization is not None else f"{where}.quant_method: "
        raise ValueError(f"{prefix}unknown quantization method {name!r}; registered: {list_quantization_methods()} "
                         "(None = unquantized)")
    return get_quantization_config_cls(name).from_config(dict(hf_quant or {}))


def _plan_native_gguf(files: ModelFiles, model_cls) -> NativeGGUFPlan:
    """quantization="gguf": the GGUF file the model came from, its tensor types checked (ValueError) before
    anything is allocated."""
    source = Path(files.source) if files.source is not None else None
    if source is None or source.suffix.lower() != ".gguf":
        raise ValueError(f"quantization={GGUF_METHOD!r} loads a .gguf file's quantized blocks natively, but "
                         f"{source or files.path} is not a .gguf file (name a .gguf, or the default model)")
    return plan_native_gguf(source, model_cls, files.hf_config)


def process_weights_after_loading(model: nn.Module) -> None:
    """Give every linear layer's method its one chance to repack what it loaded (see LinearMethodBase); a tied
    LM head shares its embedding's method and parameters, so each method runs once."""
    seen: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            method = getattr(module, "linear_method", None)
            if method is not None and id(method) not in seen:
                seen.add(id(method))
                method.process_weights_after_loading(module)


def build_model(files: ModelFiles, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu",
                quantization: str | None = None) -> nn.Module:
    """Registry lookup by config.architectures[0], construct on `device` in `dtype` with the weight format
    `resolve_quant_config` picks, load weights, let each linear method post-process them, eval().
    quantization="gguf" (a model opened from a .gguf): weights read straight from that file, Q8_0/Q4_0/Q4_1
    linears kept in their blocks (gguf_native.py). On CPU the weights end in one huge-page arena (weight_arena.py)."""
    config = files.hf_config
    cfg_file = Path(files.path) / CONFIG_NAME
    arena = arena_mode() if torch.device(device).type == "cpu" else "off"  # a bad PAGELLM_WEIGHT_ARENA: before loading
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError(f"{cfg_file}: no 'architectures' entry; cannot pick a model class")
    try:
        cls = get_model_cls(archs[0])
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from None
    native = _plan_native_gguf(files, cls) if quantization == GGUF_METHOD else None
    quant_config = native.quant_config if native is not None else resolve_quant_config(quantization, config, cfg_file)
    if native is None and quant_config is not None:  # refuse what the format cannot load before allocating
        quant_config.check_checkpoint(tensor_headers(files))
    torch_dtype = resolve_dtype(dtype, config)
    with torch.device(device):
        # unquantized: built exactly as before, so model classes that take no quant_config still load
        extra = {} if quant_config is None else {"quant_config": quant_config}
        model = cls(config, torch_dtype, **extra)

    where: dict[str, Path] = {}

    def weights():
        if native is not None:  # straight from the .gguf: quantized blocks + dequantized float tensors
            where["file"] = native.path
            yield from native.weights()
            return
        # a tensor-parallel rank reads only its slices: views of the mapped files, narrowed before the copy
        # (a pipeline stage likewise: the tensors of other stages' layers are skipped without being read)
        source = (iter_weights_with_file(files) if get_tp_size() == 1 and get_pp_size() == 1
                  else iter_mmap_weights_with_file(weight_files(Path(files.path))))
        for f, name, tensor in source:
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
    process_weights_after_loading(model)
    if arena != "off":  # CPU decode streams every weight per token: one huge-page allocation (weight_arena.py)
        pack_weights(model, huge_pages=arena == "huge")
    return model.eval()
