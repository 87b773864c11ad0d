"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) against a pagellm model.

Every check runs before anything is handed back, so a bad adapter never reaches the model's slots:
the rank (<= max_lora_rank), every `target_modules` entry naming a linear of the model, every tensor
belonging to such a linear with the shapes its layer needs. HF linears that pagellm merges (q/k/v into
qkv_proj, gate/up into gate_up_proj, per `model.stacked_params_mapping`) come back as shards of the merged
layer. Under tensor parallelism shapes are checked against the whole HF linear, then each pair is cut to
the rank's part (`LinearShardPlan.slice_lora`: B's rows of a column-parallel layer, A's input columns of a
row-parallel one).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from pagellm.distributed.pipeline import absent_prefixes
from pagellm.layers.linear import Linear, MergedLinear

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_TENSOR_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class LinearTarget:
    """Where an HF linear lives in the pagellm model: the module's name and its shard id (None: whole layer)."""

    module_name: str
    shard_id: object
    in_features: int   # of the whole HF linear (a tensor-parallel layer holds part of it)
    out_features: int  # of this shard, whole
    module: Linear | None = None


@dataclass
class PEFTAdapter:
    """A checked adapter. `weights[module_name][shard_id] = (A [r, in], B [out_shard, r])` in the model dtype."""

    path: str
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    weights: dict[str, dict[object, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def hf_linear_targets(model: nn.Module) -> dict[str, LinearTarget]:
    """HF linear name (e.g. "model.layers.0.self_attn.q_proj") -> its place in `model`."""
    mapping = getattr(model, "stacked_params_mapping", [])
    targets: dict[str, LinearTarget] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        parent, _, leaf = name.rpartition(".")
        plan = module.tp_plan
        in_features = module.in_features if plan is None else plan.full_in_features(module.in_features)
        if isinstance(module, MergedLinear):
            for merged, hf, shard in mapping:
                if merged == leaf and shard in module.shard_offsets:
                    size = module.shard_offsets[shard][1]
                    size = size if plan is None else plan.full_out_features(shard, size)
                    targets[f"{parent}.{hf}"] = LinearTarget(name, shard, in_features, size, module)
        else:
            size = module.out_features if plan is None else plan.full_out_features(None, module.out_features)
            targets[name] = LinearTarget(name, None, in_features, size, module)
    return targets


def _read_config(path: str, max_lora_rank: int) -> tuple[dict, int, float]:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {path!r}: r must be an int >= 1, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {path!r}: rank {rank} exceeds max_lora_rank={max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {path!r}: lora_alpha must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r}: per-module {key} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias={config['bias']!r} is not supported (only 'none')")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
    # fan_in_fan_out concerns how the *base* weight is stored (GPT-2 Conv1D); lora_A / lora_B are saved in
    # nn.Linear layout either way, and pagellm's linears are nn.Linear-shaped, so it changes nothing here.
    return config, rank, float(scale)


def _check_target_modules(path: str, target_modules, targets: dict[str, LinearTarget]) -> None:
    if target_modules is None or target_modules == "all-linear":
        return
    names = list(targets)
    if isinstance(target_modules, str):
        if not any(re.fullmatch(target_modules, n) for n in names):
            raise ValueError(f"LoRA adapter {path!r}: target_modules {target_modules!r} matches no linear of the model")
        return
    leaves = sorted({n.rpartition(".")[2] for n in names})
    for entry in target_modules:
        if not any(n == entry or n.endswith(f".{entry}") for n in names):
            raise ValueError(f"LoRA adapter {path!r}: target module {entry!r} does not exist in the model "
                             f"(its linears: {leaves})")


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # noqa: PLC0415

    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}")
    return load_file(weights_path, device="cpu")


def load_peft_adapter(path: str, model: nn.Module, max_lora_rank: int, dtype: torch.dtype) -> PEFTAdapter:
    """Read and check the PEFT adapter in directory `path` for `model`. ValueError names what is wrong."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a directory")
    config, rank, scale = _read_config(path, max_lora_rank)
    targets = hf_linear_targets(model)
    other_stages = absent_prefixes(model)  # a pipeline stage holds (and takes the adapter of) its own layers only
    if not other_stages:  # a stage cannot tell a pattern that matches only another stage's layers from a typo
        _check_target_modules(path, config.get("target_modules"), targets)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        m = _TENSOR_RE.match(key.removeprefix(_PREFIX))
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: unexpected tensor {key!r} (expected <module>.lora_A/B.weight)")
        if other_stages and m["module"].startswith(other_stages):
            continue
        if m["module"] not in targets:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} belongs to {m['module']!r}, "
                             f"which is not a linear of the model")
        pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r} holds no lora_A / lora_B tensors")
    adapter = PEFTAdapter(path=path, rank=rank, scale=scale)
    for hf_name, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {hf_name} needs both lora_A and lora_B, got {sorted(ab)}")
        t = targets[hf_name]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, t.in_features) or tuple(b.shape) != (t.out_features, rank):
            raise ValueError(f"LoRA adapter {path!r}: {hf_name} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                             f"must be {(rank, t.in_features)} / {(t.out_features, rank)}")
        if t.module.tp_plan is not None:  # this tensor-parallel rank's part, as its base weight is cut
            a, b = t.module.tp_plan.slice_lora(a, b, t.shard_id)
        adapter.weights.setdefault(t.module_name, {})[t.shard_id] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return adapter
