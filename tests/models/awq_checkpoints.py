"""Writing tiny AutoAWQ-format checkpoints for the AWQ loading tests.

`write_awq_dir` saves a transformers model, then replaces every decoder linear's `weight` (q/k/v/o,
gate/up/down) by AutoAWQ's `qweight` / `qzeros` / `scales` (round-to-nearest `quantize_awq`, scales in fp16
as AutoAWQ stores them) unless its name contains an entry of `modules_to_not_convert`, and writes the
`quantization_config` AutoAWQ puts in config.json. It returns a deep copy of the model whose weights are
the dequantized ones (`dequantize_awq`): the float32 model pagellm must reproduce.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagellm.quantization.awq_format import dequantize_awq, quantize_awq

AWQ_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def awq_quantization_config(group_size: int, modules_to_not_convert=None, **changes) -> dict:
    """config.json's quantization_config as AutoAWQ writes it (transformers' AwqConfig adds more keys)."""
    cfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
           "modules_to_not_convert": modules_to_not_convert}
    cfg.update(changes)
    return cfg


def is_awq_linear(name: str, modules_to_not_convert=()) -> bool:
    module = name.removesuffix(".weight")
    return (name.endswith(".weight") and module.rpartition(".")[2] in AWQ_LINEARS
            and not any(skip in module for skip in modules_to_not_convert))


def write_awq_dir(hf_model, path: Path, group_size: int, modules_to_not_convert=None, *,
                  quantize_group_size: int | None = None):
    """Save `hf_model` AWQ-quantized into `path` (safetensors + config.json); returns (path, the dequantized model).
    `quantize_group_size` (default `group_size`) quantizes with another group than the config states."""
    path = Path(path)
    hf_model.save_pretrained(path, safe_serialization=True)
    weights_file = path / "model.safetensors"
    tensors = load_file(weights_file)
    dequantized = copy.deepcopy(hf_model)
    params = dict(dequantized.named_parameters())
    skip = modules_to_not_convert or []
    for name in [n for n in tensors if is_awq_linear(n, skip)]:
        weight = tensors.pop(name)
        group = quantize_group_size or group_size
        group = weight.shape[1] if group == -1 else group
        qweight, qzeros, scales = quantize_awq(weight, group)
        module = name.removesuffix(".weight")
        tensors.update({f"{module}.qweight": qweight, f"{module}.qzeros": qzeros, f"{module}.scales": scales})
        with torch.no_grad():
            params[name].copy_(dequantize_awq(qweight, qzeros, scales, group))
    save_file(tensors, weights_file, metadata={"format": "pt"})
    set_quantization_config(path, awq_quantization_config(group_size, modules_to_not_convert))
    return path, dequantized


def set_quantization_config(path: Path, quantization_config: dict | None) -> None:
    """Replace (None: remove) config.json's quantization_config."""
    cfg_file = Path(path) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    cfg_file.write_text(json.dumps(cfg, indent=2))


def rewrite_tensors(path: Path, change) -> None:
    """Apply `change(tensors: dict)` to the checkpoint's tensors in place."""
    weights_file = Path(path) / "model.safetensors"
    tensors = load_file(weights_file)
    change(tensors)
    save_file(tensors, weights_file, metadata={"format": "pt"})
