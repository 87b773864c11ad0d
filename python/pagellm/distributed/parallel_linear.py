"""How a Linear / MergedLinear / QKVLinear becomes column- or row-parallel (`tp_mode`).

    column   the output rows are split: every output shard (q/k/v, gate/up) keeps its part, so the merged
             layer's local layout is [q_r | k_r | v_r] and the activation/attention that follow need no
             communication. QKV is split by heads (sharding.partition_heads).
    row      the input columns are split (the input is the column-parallel layer's local output); each rank
             computes a partial y, an all-reduce sums them, and the bias (kept whole) is added once after.

A layer's `LinearShardPlan` holds the slices of the full checkpoint tensors this rank loads; the layer's
weight_loader cuts each HF tensor with `slice_checkpoint` before the usual shape-checked copy, so a rank
keeps only its part. Quantized tensors are cut in their stored layout, as the parameter's attributes say
(quantization.base.new_linear_param): output rows along `output_dim`, `output_pack_factor` rows per stored
element (AWQ's 8 nibbles per int32); input columns along `input_dim`, `input_units = (elements, stored)`
inputs per stored entries (AWQ scales: (group, 1); GGUF blocks: (32 or 256, block bytes)), so a cut that
falls inside a packed element, a group or a block is a ValueError naming the layer. A method that
quantizes at load (int8) takes the float slice and quantizes it on the rank.
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

    def full_in_features(self, local_in_features: int) -> int:
        """The checkpoint's in_features of a layer holding `local_in_features` on this rank."""
        return local_in_features * get_tp_state().size if self.mode == "row" else local_in_features

    def full_out_features(self, shard_id, local_rows: int) -> int:
        """The checkpoint's rows of shard `shard_id` (None: an unmerged layer) holding `local_rows` here."""
        if self.mode == "row":
            return local_rows
        return self.full_sizes[self.shard_ids.index(shard_id if shard_id is not None else self.shard_ids[0])]

    def slice_lora(self, lora_a: torch.Tensor, lora_b: torch.Tensor, shard_id) -> tuple[torch.Tensor, torch.Tensor]:
        """A LoRA pair of the whole HF linear (A [r, in], B [rows, r]) -> this rank's, consistent with the base
        weight: column mode keeps B's rows of this rank (x A^T is the same on every rank); row mode keeps A's
        input columns (x_r A_r^T is a partial sum, reduced with the base layer's, parallel_linear)."""
        if self.mode == "row":
            return lora_a.narrow(1, *self.input_slice), lora_b
        key = shard_id if shard_id is not None else self.shard_ids[0]
        return lora_a, lora_b.narrow(0, *self.output_slices[key])

    def slice_checkpoint(self, loaded: torch.Tensor, shard_id, param=None, prefix: str = "") -> torch.Tensor:
        """The part of the full checkpoint tensor `loaded` (HF shard `shard_id`, or the whole merged tensor
        for None) this rank holds, cut in the layout `param` stores (module docstring): its output rows for
        column mode, its input columns for row mode (a tensor without an input dim, e.g. a bias, stays whole)."""
        if self.mode == "row":
            dim = _input_dim(param, loaded)
            if dim is None:
                return loaded
            elements, stored = getattr(param, "input_units", (1, 1))
            start, cols = self.input_slice
            return loaded.narrow(dim, *_stored_range(start, cols, elements, stored, prefix, "input columns"))
        dim = getattr(param, "output_dim", 0)
        dim = 0 if dim is None else dim  # a method loading shards its own way still gets rows along dim 0
        pack = getattr(param, "output_pack_factor", 1)
        if loaded.dim() <= dim:
            return loaded  # the shape-checked copy reports it
        if shard_id is not None or len(self.shard_ids) == 1:
            key = shard_id if shard_id is not None else self.shard_ids[0]
            if key not in self.output_slices:
                raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.output_slices)}")
            return loaded.narrow(dim, *_stored_range(*self.output_slices[key], pack, 1, prefix, "output rows"))
        if loaded.shape[dim] * pack != sum(self.full_sizes):  # shape errors are reported by the shape-checked copy
            return loaded
        pieces = loaded.split([size // pack for size in self.full_sizes], dim=dim)  # an already-merged tensor
        return torch.cat([p.narrow(dim, *_stored_range(*self.output_slices[sid], pack, 1, prefix, "output rows"))
                          for sid, p in zip(self.shard_ids, pieces)], dim=dim)


def _input_dim(param, loaded: torch.Tensor) -> int | None:
    """Where a checkpoint tensor's input columns are: the parameter's `input_dim` (None: not split by input,
    e.g. one AWQ group spanning every input), by default the last dim of a 2-D tensor (a bias has none)."""
    if param is not None and hasattr(param, "input_dim"):
        return param.input_dim
    return 1 if loaded.dim() >= 2 else None


def _stored_range(start: int, length: int, elements: int, stored: int, prefix: str, what: str) -> tuple[int, int]:
    """Logical range [start, start + length) -> (first, count) of stored entries, `elements` logical per
    `stored` entries; ValueError when the cut does not fall on a whole unit."""
    if start % elements or length % elements:
        raise ValueError(f"{prefix or 'linear'}: this rank's {what} [{start}, {start + length}) do not fall on "
                         f"whole units of {elements} (a packed element, quantization group or block): choose a "
                         f"tensor_parallel_size that splits them into multiples of {elements}")
    return start // elements * stored, length // elements * stored


def _check_mode(tp_mode) -> bool:
    """True when the layer is split (a mode given and more than one rank)."""
    if tp_mode is None:
        return False
    if tp_mode not in TP_MODES:
        raise ValueError(f"tp_mode must be one of {TP_MODES} or None, got {tp_mode!r}")
    if get_tp_state().size == 1:
        return False
    return True


def plan_linear(tp_mode, in_features: int, shard_sizes: list[int], shard_ids: list | None,
                prefix: str = "") -> LinearShardPlan | None:
    """The plan of a plain or merged linear (even split of every output shard, or of the input); None when
    the layer is not split. ValueError when a size does not divide by the number of ranks."""
    if not _check_mode(tp_mode):
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


def plan_qkv(tp_mode, head_dim: int, num_heads: int, num_kv_heads: int, prefix: str = "") -> LinearShardPlan | None:
    """QKV split by heads (column mode only): q heads / tp, KV heads / tp or the replicated one."""
    if not _check_mode(tp_mode):
        return None
    if tp_mode != "column":
        raise ValueError(f"{prefix or 'qkv'}: a QKV projection is column-parallel, got tp_mode={tp_mode!r}")
    state = get_tp_state()
    heads = partition_heads(num_heads, num_kv_heads, state.rank, state.size)
    kv = (heads.kv_start * head_dim, heads.num_kv_heads * head_dim)
    slices = {"q": (heads.q_start * head_dim, heads.num_heads * head_dim), "k": kv, "v": kv}
    full = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
    return LinearShardPlan("column", ("q", "k", "v"), full, slices, None)


def _local_partial(layer, x: torch.Tensor) -> torch.Tensor:
    """This rank's partial product, plus what `layer.partial_output_hook(layer, x, y) -> y` adds to it (a LoRA
    term over the same input columns: one all-reduce then sums both, as vLLM's row-parallel LoRA does)."""
    y = layer.linear_method.apply(layer, x, None)
    hook = getattr(layer, "partial_output_hook", None)
    return y if hook is None else hook(layer, x, y)


def row_parallel_apply(layer, x: torch.Tensor) -> torch.Tensor:
    """x [..., in/tp] -> [..., out]: the local partial product, summed over the ranks, then the bias once."""
    y = tensor_model_parallel_all_reduce(_local_partial(layer, x))
    return y if layer.bias is None else y + layer.bias


def row_parallel_partial(layer, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel `layer`'s output before the all-reduce (the bias added on rank 0 only), for a block that
    sums several partial terms and reduces once (a MoE layer's shared expert); `layer(x)` when not split."""
    plan = getattr(layer, "tp_plan", None)
    if plan is None or plan.mode != "row":
        return layer(x)
    y = _local_partial(layer, x)
    return y + layer.bias if layer.bias is not None and get_tp_state().rank == 0 else y


def checkpoint_shape(module, param, shard_id, local_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The full checkpoint shape of a tensor whose part on this rank has `local_shape` (what a weight update
    must supply): the local shape unless `module` is split (a Linear's tp_plan or a vocabulary layer's
    vocab_shard), along the dims the parameter's attributes name (`input_dim`, `output_dim`)."""
    shape = list(local_shape)
    plan = getattr(module, "tp_plan", None)
    vocab = getattr(module, "vocab_shard", None)
    if vocab is not None and shape:
        shape[0] = vocab.vocab_size
    elif plan is not None and plan.mode == "row":
        dim = getattr(param, "input_dim", 1 if len(shape) >= 2 else None)
        if dim is not None and dim < len(shape):
            shape[dim] = local_shape[dim] * get_tp_state().size  # even split of the input columns
    elif plan is not None and plan.mode == "column" and shape:
        dim = getattr(param, "output_dim", 0)
        dim = 0 if dim is None or dim >= len(shape) else dim
        full = plan.full_sizes[plan.shard_ids.index(shard_id)] if shard_id is not None else sum(plan.full_sizes)
        shape[dim] = full // getattr(param, "output_pack_factor", 1)
    return tuple(shape)
