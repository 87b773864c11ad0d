"""Loading checkpoint tensors into parameters: the loader contract shared by layers and LinearMethods.

A parameter's `weight_loader(param, loaded_weight, shard_id=None)` copies one checkpoint tensor in
(shape-checked); merged layers turn an HF shard id into an `OutputShard` and hand it to the parameter's
`shard_loader` (default `load_output_slice`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class WeightShapeError(ValueError):
    """A checkpoint tensor's shape does not match the parameter (or shard) it loads into."""


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Copy `loaded_weight` into `param` (dtype-converting), after checking the shape."""
    if shard_id is not None:
        raise ValueError(f"parameter does not take shards (got shard_id={shard_id!r})")
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise WeightShapeError(f"shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded_weight.shape)}")
    with torch.no_grad():
        param.data.copy_(loaded_weight)


@dataclass(frozen=True)
class OutputShard:
    """Where one checkpoint tensor (q_proj, gate_proj, ...) lands in a merged layer: rows
    [offset, offset + size) of the logical [out, in] weight; `index` is its position among the shards."""

    shard_id: object
    index: int
    offset: int
    size: int


def set_weight_attrs(param: torch.Tensor, attrs: dict) -> None:
    """Attach loading metadata to a parameter (refusing to overwrite an attribute it already has)."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def load_output_slice(param: torch.Tensor, loaded_weight: torch.Tensor, shard: OutputShard | None) -> None:
    """The default shard loader: the whole parameter (shard None), or the slice `shard` selects along
    `param.output_dim` (default 0). A parameter packed along its output dim (`output_pack_factor` logical
    rows per stored element) takes offset and size divided by that factor."""
    if shard is None:
        default_weight_loader(param, loaded_weight)
        return
    dim = getattr(param, "output_dim", 0)
    if dim is None:
        raise ValueError("parameter has no output dim (output_dim=None): its LinearMethod must give a shard_loader")
    pack = getattr(param, "output_pack_factor", 1)
    if shard.offset % pack or shard.size % pack:
        raise WeightShapeError(f"shard {shard.shard_id!r} (rows {shard.offset}+{shard.size}) is not a multiple of "
                               f"the output pack factor {pack}")
    target = param.data.narrow(dim, shard.offset // pack, shard.size // pack)
    if tuple(target.shape) != tuple(loaded_weight.shape):
        raise WeightShapeError(f"shape mismatch for shard {shard.shard_id!r}: expected {tuple(target.shape)}, "
                               f"got {tuple(loaded_weight.shape)}")
    with torch.no_grad():
        target.copy_(loaded_weight)
