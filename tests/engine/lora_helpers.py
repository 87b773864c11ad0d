"""Writing random PEFT LoRA adapters for the tiny Llama, and the merged-weights checkpoint they equal."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}


def linear_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """HF linear leaf name -> (out_features, in_features) of the Llama in `model_dir`."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def write_peft_adapter(path: Path, model_dir: Path, *, rank: int, alpha: float, targets: list[str], seed: int,
                       use_rslora: bool = False, std: float = 0.15) -> Path:
    """A PEFT-format adapter with random A and B (B non-zero, unlike PEFT's init, so it changes outputs)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((model_dir / "config.json").read_text())
    shapes = linear_shapes(model_dir)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for leaf in targets:
            out_f, in_f = shapes[leaf]
            module = f"base_model.model.model.layers.{layer}.{'self_attn' if leaf in _ATTN else 'mlp'}.{leaf}"
            tensors[f"{module}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * std
            tensors[f"{module}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * std
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": rank,
              "lora_alpha": alpha, "target_modules": targets, "use_rslora": use_rslora, "fan_in_fan_out": False,
              "bias": "none", "lora_dropout": 0.0, "inference_mode": True}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def write_merged_checkpoint(model_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """A copy of `model_dir` with W + scale * B @ A folded into every adapted linear (the reference)."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    weights = load_file(str(model_dir / "model.safetensors"))
    lora = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").rsplit(".lora_A.", 1)[0]
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        w = weights[f"{module}.weight"]
        weights[f"{module}.weight"] = (w.double() + scale * (b.double() @ a.double())).to(w.dtype)
    shutil.copytree(model_dir, out_dir)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
