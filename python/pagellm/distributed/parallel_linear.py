"""How a Linear / MergedLinear / QKVLinear becomes column- or row-parallel (`tp_mode`).

    column   the output rows are split: every output shard (q/k/v, gate/up) keeps its part, so the merged
             layer's local layout is [q_r | k_r | v_r] and the activation/attention that follow need no
             communication. QKV is split by heads (sharding.partition_heads).
    row      the input columns are split (the input is the column-parallel layer's local output); each rank
             computes a partial y, an all-reduce sums them, and the bias (kept whole) is added once after.

A layer's `LinearShardPlan` holds the slices of the full checkpoint tensors this rank loads; the layer's
weight_loader cuts each HF tensor with `slice_checkpoint` before the usual shape-checked copy, so a rank
keeps only its part. Unquantized weights only: a quantized method + TP is refused at construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.distributed.communication import tensor_model_parallel_all_reduce
from pagellm.distributed.parallel_state import get_tp_state
from pagellm.distributed.sharding import divide, partition_heads

TP_MODES = ("column", "row")


@dataclass(frozen=True)
class LinearShardPlan:
    """This rank's part of one linear layer.

    mode "column": `output_slices[shard_id] = (first row, rows)` of each full checkpoint shard (shard id None:
    an unmerged layer), `full_sizes` the full shard sizes in layout order. mode "row": `input_slice =
    (first column, columns)`."""

    mode: str
    shard_ids: tuple
    full_sizes: tuple[int, ...]
    output_slices: dict
    input_slice: tuple[int, int] | None

    @property
    def local_output_sizes(self) -> list[int]:
        if self.mode == "row":
            return list(self.full_sizes)
        return [self.output_slices[sid][1] for sid in self.shard_ids]

    def local_in_features(self, in_features: int) -> int:
        return in_features if self.input_slice is None else self.input_slice[1]

    def slice_checkpoint(self, loaded: torch.Tensor, shard_id) -> torch.Tensor:
        """The part of the full checkpoint tensor `loaded` (HF shard `shard_id`, or the whole merged tensor
        for None) this rank holds: rows for column mode, columns of a 2-D weight for row mode (a 1-D bias
        of a row-parallel layer stays whole)."""
        if self.mode == "row":
            return loaded if loaded.dim() < 2 else loaded.narrow(1, *self.input_slice)
        if shard_id is not None or len(self.shard_ids) == 1:
            key = shard_id if shard_id is not None else self.shard_ids[0]
            if key not in self.output_slices:
                raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.output_slices)}")
            return loaded.narrow(0, *self.output_slices[key])
        if loaded.shape[0] != sum(self.full_sizes):  # shape errors are reported by the shape-checked copy
            return loaded
        pieces = loaded.split(list(self.full_sizes), dim=0)  # an already-merged checkpoint tensor
        return torch.cat([p.narrow(0, *self.output_slices[sid]) for sid, p in zip(self.shard_ids, pieces)])


def _check_mode(tp_mode, quant_config, prefix: str) -> bool:
    """True when the layer is split (a mode given and more than one rank)."""
    if tp_mode is None:
        return False
    if tp_mode not in TP_MODES:
        raise ValueError(f"tp_mode must be one of {TP_MODES} or None, got {tp_mode!r}")
    if get_tp_state().size == 1:
        return False
    if quant_config is not None:
        raise ValueError(f"{prefix or 'linear'}: tensor parallelism supports unquantized weights only for now "
                         f"(got quantization {quant_config.get_name()!r})")
    return True


def plan_linear(tp_mode, in_features: int, shard_sizes: list[int], shard_ids: list | None, quant_config,
                prefix: str = "") -> LinearShardPlan | None:
    """The plan of a plain or merged linear (even split of every output shard, or of the input); None when
    the layer is not split. ValueError when a size does not divide by the number of ranks."""
    if not _check_mode(tp_mode, quant_config, prefix):
        return None
    state = get_tp_state()
    ids = tuple(shard_ids) if shard_ids is not None else (None,) if len(shard_sizes) == 1 else tuple(range(len(shard_sizes)))
    if tp_mode == "row":
        cols = divide(in_features, state.size, f"{prefix or 'linear'} input features")
        return LinearShardPlan("row", ids, tuple(shard_sizes), {}, (state.rank * cols, cols))
    slices = {}
    for sid, size in zip(ids, shard_sizes):
        rows = divide(size, state.size, f"{prefix or 'linear'} output features")
        slices[sid] = (state.rank * rows, rows)
    return LinearShardPlan("column", ids, tuple(shard_sizes), slices, None)


def plan_qkv(tp_mode, head_dim: int, num_heads: int, num_kv_heads: int, quant_config,
             prefix: str = "") -> LinearShardPlan | None:
    """QKV split by heads (column mode only): q heads / tp, KV heads / tp or the replicated one."""
    if not _check_mode(tp_mode, quant_config, prefix):
        return None
    if tp_mode != "column":
        raise ValueError(f"{prefix or 'qkv'}: a QKV projection is column-parallel, got tp_mode={tp_mode!r}")
    state = get_tp_state()
    heads = partition_heads(num_heads, num_kv_heads, state.rank, state.size)
    kv = (heads.kv_start * head_dim, heads.num_kv_heads * head_dim)
    slices = {"q": (heads.q_start * head_dim, heads.num_heads * head_dim), "k": kv, "v": kv}
    full = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
    return LinearShardPlan("column", ("q", "k", "v"), full, slices, None)


def row_parallel_apply(layer, x: torch.Tensor) -> torch.Tensor:
    """x [..., in/tp] -> [..., out]: the local partial product, summed over the ranks, then the bias once."""
    y = tensor_model_parallel_all_reduce(layer.linear_method.apply(layer, x, None))
    return y if layer.bias is None else y + layer.bias


def row_parallel_partial(layer, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel `layer`'s output before the all-reduce (the bias added on rank 0 only), for a block that
    sums several partial terms and reduces once (a MoE layer's shared expert); `layer(x)` when not split."""
    plan = getattr(layer, "tp_plan", None)
    if plan is None or plan.mode != "row":
        return layer(x)
    y = layer.linear_method.apply(layer, x, None)
    return y + layer.bias if layer.bias is not None and get_tp_state().rank == 0 else y


def checkpoint_shape(module, param, shard_id, local_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The full checkpoint shape of a tensor whose part on this rank has `local_shape` (what a weight update
    must supply): the local shape unless `module` is split (a Linear's tp_plan or a vocabulary layer's
    vocab_shard)."""
    shape = list(local_shape)
    plan = getattr(module, "tp_plan", None)
    vocab = getattr(module, "vocab_shard", None)
    if vocab is not None and shape:
        shape[0] = vocab.vocab_size
    elif plan is not None and plan.mode == "row" and len(shape) >= 2:
        shape[1] = local_shape[1] * get_tp_state().size  # even split of the input columns
    elif plan is not None and plan.mode == "column" and shape:
        if shard_id is not None:
            shape[0] = plan.full_sizes[plan.shard_ids.index(shard_id)]
        else:
            shape[0] = sum(plan.full_sizes)
    return tuple(shape)
