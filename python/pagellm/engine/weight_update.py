"""In-place weight updates of a built model (an RL trainer pushing new weights every step).

    plan = plan_weight_update(model, [(hf_name, tensor), ...], check_finite=False)   # checks only
    apply_weight_update(model, plan)                                                  # writes

`plan_weight_update` checks every tensor (name, shape, dtype, optionally finiteness) before any parameter
is touched, so a bad call leaves the old weights intact: updates are all or nothing per call. Names are
the checkpoint's (HF) names, as `load_weights` takes them; each tensor goes through its parameter's
`weight_loader`, so merged (q/k/v, gate/up) and quantize-on-load (int8) layouts are handled as when
loading (a MoE model's per-expert or stacked expert tensors through FusedMoE's loader), then the touched
layers' `process_weights_after_loading` runs again. A layer whose method
replaced its checkpoint tensors after loading (AWQ's repack) cannot take updates and is refused.

Sources besides an in-memory iterable: `read_weights_from_disk` (a safetensors file or HF directory) and
`receive_weights_broadcast` (torch.distributed broadcast from a trainer rank: gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from pagellm.distributed.parallel_linear import checkpoint_shape
from pagellm.distributed.pipeline import absent_prefixes

# Set on a parameter whose loader quantizes a float checkpoint tensor (int8's weight): it takes float tensors.
QUANTIZES_ON_LOAD_ATTR = "quantizes_on_load"
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class WeightUpdateError(ValueError):
    """An update refused before any parameter changed; `tensor_name` is the offending HF name."""

    def __init__(self, tensor_name: str, message: str) -> None:
        self.tensor_name = tensor_name
        super().__init__(f"weight update refused, tensor {tensor_name!r}: {message} (no weights were changed)")


@dataclass(frozen=True)
class PlannedLoad:
    """One checked tensor: the parameter it loads into and the shard id its weight_loader takes."""

    hf_name: str
    param_name: str
    shard_id: Any
    tensor: torch.Tensor
    expert_id: int | None = None  # a MoE expert tensor: shard_id is then its expert shard ("gate"/"up"/"down")
    is_expert: bool = False


def _owning_module(modules: dict[str, nn.Module], param_name: str) -> nn.Module | None:
    return modules.get(param_name.rpartition(".")[0])


def _expected_shape(module: nn.Module | None, param: nn.Parameter, shard_id: Any) -> tuple[int, ...]:
    """The checkpoint shape this (param, shard) takes: the parameter's, or its shard's slice along output_dim."""
    if shard_id is None:  # (a tensor-parallel rank's part of a split layer: the full tensor is expected)
        return checkpoint_shape(module, param, None, tuple(param.shape))
    shard = module.output_shard(shard_id)  # ValueError for an unknown shard id
    dim = getattr(param, "output_dim", 0)
    if dim is None:
        raise ValueError("its parameter is not split along an output dim; shard-wise updates are not supported")
    shape = list(param.shape)
    shape[dim] = shard.size // getattr(param, "output_pack_factor", 1)
    return checkpoint_shape(module, param, shard_id, tuple(shape))


def _check_dtype(param: nn.Parameter, tensor: torch.Tensor) -> str | None:
    wants_float = param.is_floating_point() or getattr(param, QUANTIZES_ON_LOAD_ATTR, False)
    if wants_float and tensor.dtype not in _FLOAT_DTYPES:
        return f"dtype {tensor.dtype} is not a float dtype ({', '.join(map(str, _FLOAT_DTYPES))})"
    if not wants_float and tensor.dtype != param.dtype:
        return f"dtype {tensor.dtype}, but this parameter is stored as {param.dtype} and takes exactly that"
    return None


def _check_not_repacked(module: nn.Module | None, param: nn.Parameter, name: str) -> None:
    method = getattr(module, "linear_method", None)
    if method is not None and not hasattr(param, "weight_loader"):
        raise WeightUpdateError(name, f"its layer's weight format ({type(method).__name__}) repacked the checkpoint "
                                      "tensors after loading, so it cannot be updated in place; re-create the LLM")


def plan_weight_update(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       check_finite: bool = False) -> list[PlannedLoad]:
    """Check every (hf_name, tensor) against `model` without changing it; WeightUpdateError on the first bad one:
    a name the model has no parameter for, a wrong shape, a wrong dtype (float parameters take any float
    dtype, converted as when loading; integer-stored ones their own dtype), NaN/Inf when `check_finite`.
    Checkpoint tensors the model ignores (rotary caches, a tied LM head) are dropped, as `load_weights` does."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    ignored = tuple(getattr(model, "ignored_weight_suffixes", ()))
    tied = bool(getattr(model, "tie_word_embeddings", False))
    other_stages = absent_prefixes(model)  # a pipeline stage takes its own layers' tensors, skips the others'
    to_expert = getattr(model, "_hf_to_expert_param", lambda _name: None)
    plan: list[PlannedLoad] = []
    for item in named_tensors:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise TypeError(f"named_tensors must yield (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected (str, torch.Tensor), got ({type(name).__name__}, {type(tensor).__name__})")
        if (name.endswith(ignored) or (tied and name.startswith("lm_head."))
                or (other_stages and name.startswith(other_stages))):
            continue
        expert = to_expert(name)  # (FusedMoE parameter, expert id, shard) or None
        pname, shard_id = (expert[0], expert[2]) if expert is not None else model._hf_to_param(name)
        param = params.get(pname)
        if param is None:
            raise WeightUpdateError(name, f"{type(model).__name__} has no parameter for it")
        module = _owning_module(modules, pname)
        _check_not_repacked(module, param, name)
        try:
            expected = (module.checkpoint_shape(param, expert[1], expert[2]) if expert is not None
                        else _expected_shape(module, param, shard_id))
        except ValueError as e:
            raise WeightUpdateError(name, str(e)) from None
        if tuple(tensor.shape) != expected:
            raise WeightUpdateError(name, f"shape {tuple(tensor.shape)}, expected {expected}")
        problem = _check_dtype(param, tensor)
        if problem is not None:
            raise WeightUpdateError(name, problem)
        if check_finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise WeightUpdateError(name, "contains NaN or Inf (check_finite=True)")
        plan.append(PlannedLoad(name, pname, shard_id, tensor, expert[1] if expert else None, expert is not None))
    return plan


def apply_weight_update(model: nn.Module, plan: Sequence[PlannedLoad]) -> int:
    """Load the checked tensors through their weight_loaders, then let each touched linear method
    post-process its layer again (e.g. pick its kernel). Returns the number of tensors loaded."""
    from pagellm.weight_utils import default_weight_loader  # noqa: PLC0415

    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    touched: dict[int, nn.Module] = {}
    with torch.no_grad():
        for load in plan:
            param = params[load.param_name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if load.is_expert:
                loader(param, load.tensor, load.expert_id, load.shard_id)
            elif load.shard_id is None:
                loader(param, load.tensor)
            else:
                loader(param, load.tensor, load.shard_id)
            module = _owning_module(modules, load.param_name)
            if getattr(module, "linear_method", None) is not None:
                touched[id(module)] = module
        seen_methods: set[int] = set()
        for module in touched.values():
            method = module.linear_method
            if id(method) not in seen_methods:  # a tied head shares its embedding's method
                seen_methods.add(id(method))
                method.process_weights_after_loading(module)
    return len(plan)


def update_model_weights(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]],
                         check_finite: bool = False) -> int:
    """plan (every check) then apply; returns the number of tensors loaded."""
    return apply_weight_update(model, plan_weight_update(model, named_tensors, check_finite))


# ---- sources -------------------------------------------------------------------------------------------
def read_weights_from_disk(path: str | Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a .safetensors file, or of an HF directory's safetensors files (index-ordered), read
    into memory (the update is checked as a whole before it is applied). FileNotFoundError when there are none."""
    from safetensors import safe_open  # noqa: PLC0415

    from pagellm.model_loader.files import weight_files  # noqa: PLC0415

    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        files = [p]
    elif p.is_dir():
        files = weight_files(p)
    else:
        raise FileNotFoundError(f"{p}: expected a .safetensors file or a directory of them")
    out: list[tuple[str, torch.Tensor]] = []
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            out.extend((name, fh.get_tensor(name)) for name in fh.keys())
    return out


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use a torch.dtype or its name, e.g. 'bfloat16'")
    return resolved


def receive_weights_broadcast(group, names: Sequence[str], dtypes: Sequence[torch.dtype | str],
                              shapes: Sequence[Sequence[int]], src: int = 0,
                              device: torch.device | str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Receive len(names) tensors, in order, by `torch.distributed.broadcast` from rank `src` of `group` (the
    trainer broadcasts the same tensors in the same order). Metadata is checked before anything is received."""
    import torch.distributed as dist  # noqa: PLC0415

    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized in this process (init_process_group first)")
    specs = [(str(n), _parse_dtype(d), tuple(int(s) for s in shape)) for n, d, shape in zip(names, dtypes, shapes)]
    received = []
    for name, dtype, shape in specs:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, src=src, group=group)
        received.append((name, buf))
    return received
