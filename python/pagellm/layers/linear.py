"""Linear layers whose weights are stored, loaded and multiplied by a LinearMethod (pagellm.quantization).

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies a
checkpoint tensor into the preallocated parameter (shape-checked). Merged layers (QKV, gate/up)
load each HF tensor into its slice of the merged weight, selected by `shard_id`; a method whose
tensors are laid out differently says so per parameter (`output_dim`, `output_pack_factor`, or its
own `shard_loader`), see `load_output_slice`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from pagellm.distributed.parallel_linear import LinearShardPlan, plan_linear, plan_qkv, row_parallel_apply
from pagellm.layers.folded import FoldedRows
from pagellm.ops.linear_dispatch import AMX_MAX_M, SMALL_M_MAX, linear  # noqa: F401 (re-exported)
from pagellm.quantization.base import LinearMethodBase, QuantizationConfig
from pagellm.quantization.unquantized import UnquantizedLinearMethod
from pagellm.weight_utils import (  # noqa: F401 (re-exported)
    OutputShard,
    WeightShapeError,
    default_weight_loader,
    load_output_slice,
    set_weight_attrs,
)


# ---- layers --------------------------------------------------------------------------------------
class Linear(nn.Module):
    """y = x W^T (+ b) with W [out_features, in_features] stored as its LinearMethod says.

    `quant_config` (None = unquantized: HF `nn.Linear` layout in `dtype`) picks the method for this
    layer by `prefix` (its full name, e.g. "model.layers.0.self_attn.o_proj"). The method registers the
    parameters; each one's `weight_loader(param, loaded_weight, shard_id=None)` is `self.weight_loader`,
    which turns an HF shard id into an OutputShard and hands over to the parameter's `shard_loader`
    (default `load_output_slice`).

    `tp_mode` ("column" | "row" | None, pagellm.distributed.parallel_linear): under tensor parallelism the
    layer holds this rank's rows (column) or input columns (row, all-reduced after, bias added once);
    in_features / out_features are then the local sizes and the weight_loader cuts full checkpoint tensors.
    """

    tp_plan: LinearShardPlan | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", tp_mode: str | None = None) -> None:
        super().__init__()
        self.tp_plan = plan_linear(tp_mode, in_features, [out_features], None, prefix)
        self._create_weights(in_features, [out_features], bias, dtype, device, quant_config, prefix)

    def _create_weights(self, in_features: int, output_partition_sizes: list[int], bias: bool, dtype, device,
                        quant_config: QuantizationConfig | None, prefix: str) -> None:
        if self.tp_plan is not None:  # this rank's part of the logical weight
            in_features = self.tp_plan.local_in_features(in_features)
            output_partition_sizes = self.tp_plan.local_output_sizes
        self.in_features = in_features
        self.out_features = sum(output_partition_sizes)
        self.prefix = prefix
        self.linear_method: LinearMethodBase = (
            UnquantizedLinearMethod() if quant_config is None else quant_config.get_linear_method(self, prefix)
        )
        self.register_parameter("bias", None)  # the method replaces it when bias=True
        params_dtype = dtype if dtype is not None else torch.get_default_dtype()
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.linear_method.create_weights(self, in_features, list(output_partition_sizes), self.out_features,
                                              params_dtype, bias, weight_loader=self.weight_loader)
        method = type(self.linear_method).__name__
        if bias and self.bias is None:
            raise TypeError(f"{method}.create_weights registered no bias although bias=True ({prefix or 'linear'})")
        for name, p in self._parameters.items():
            if p is not None and not hasattr(p, "weight_loader"):
                raise TypeError(f"{method}.create_weights registered {name!r} without a weight_loader")

    def output_shard(self, shard_id) -> OutputShard | None:
        """The OutputShard an HF shard id loads into; None for a whole (unsharded) tensor."""
        if shard_id is not None:
            raise ValueError(f"parameter does not take shards (got shard_id={shard_id!r})")
        return None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if self.tp_plan is not None:
            loaded_weight = self.tp_plan.slice_checkpoint(loaded_weight, shard_id, param, self.prefix)
        shard_loader = getattr(param, "shard_loader", load_output_slice)
        shard_loader(param, loaded_weight, self.output_shard(shard_id))

    def forward(self, x: torch.Tensor | FoldedRows) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features]. A FoldedRows x (a norm or activation folded into this
        layer's CUDA GEMV, layers/folded.py; only when `folds_into` allowed it) is computed by the product's kernel."""
        if isinstance(x, FoldedRows):
            return x.linear(self.weight, self.bias)
        if self.tp_plan is not None and self.tp_plan.mode == "row":
            return row_parallel_apply(self, x)
        return self.linear_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"linear_method={type(self.linear_method).__name__}")


class MergedLinear(Linear):
    """Several HF linears with the same input stacked along the output dim (e.g. gate_proj + up_proj).

    `shard_sizes[i]` output rows belong to shard `shard_ids[i]` (shard ids default to 0, 1, ...);
    `shard_offsets[shard_id] = (first row, rows)`.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype | None = None, device=None, shard_ids: list | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", tp_mode: str | None = None) -> None:
        nn.Module.__init__(self)
        ids = list(range(len(shard_sizes))) if shard_ids is None else list(shard_ids)
        if len(ids) != len(shard_sizes):
            raise ValueError("shard_ids and shard_sizes differ in length")
        self.tp_plan = self._plan_tp(tp_mode, in_features, list(shard_sizes), ids, prefix)
        if self.tp_plan is not None:  # offsets below are within this rank's [q_r | k_r | v_r] layout
            shard_sizes = self.tp_plan.local_output_sizes
        self.shard_sizes = list(shard_sizes)
        self.shard_offsets: dict = {}
        off = 0
        for sid, size in zip(ids, shard_sizes):
            self.shard_offsets[sid] = (off, size)
            off += size
        self._create_weights(in_features, self.shard_sizes, bias, dtype, device, quant_config, prefix)

    def _plan_tp(self, tp_mode, in_features: int, shard_sizes: list[int], shard_ids: list,
                 prefix: str) -> LinearShardPlan | None:
        return plan_linear(tp_mode, in_features, shard_sizes, shard_ids, prefix)

    def output_shard(self, shard_id) -> OutputShard | None:
        if shard_id is None:  # an already-merged checkpoint tensor
            return None
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_offsets)}")
        off, size = self.shard_offsets[shard_id]
        return OutputShard(shard_id, list(self.shard_offsets).index(shard_id), off, size)


class QKVLinear(MergedLinear):
    """q_proj, k_proj, v_proj merged: output rows [q (num_heads*head_dim) | k | v (num_kv_heads*head_dim)].
    `num_heads` / `num_kv_heads` are the model's; with tp_mode="column" the layer holds this rank's heads
    and q_size / kv_size are the local sizes."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype | None = None, device=None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", tp_mode: str | None = None) -> None:
        self._heads = (head_dim, num_heads, num_kv_heads)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias=bias, dtype=dtype, device=device,
                         shard_ids=["q", "k", "v"], quant_config=quant_config, prefix=prefix, tp_mode=tp_mode)
        self.q_size, self.kv_size = self.shard_sizes[0], self.shard_sizes[1]

    def _plan_tp(self, tp_mode, in_features: int, shard_sizes: list[int], shard_ids: list,
                 prefix: str) -> LinearShardPlan | None:
        return plan_qkv(tp_mode, *self._heads, prefix)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
