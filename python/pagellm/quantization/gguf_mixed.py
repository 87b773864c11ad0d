"""A merged layer whose shards a .gguf file stores in different block types, used natively.

Q4_K_M files keep attn_q / attn_k in Q4_K and attn_v in Q6_K in some layers (and Q4_K / Q5_K_M mixes more): one
`gguf_linear` call takes one type, so the merged qkv_proj holds each shard's rows of blocks one after another in
a flat uint8 `qweight` and makes one call per shard, each writing its columns of the output (the op takes an
output with a row stride). On a CPU whose packed VNNI kernel runs (half-precision model, `packing_pays_off`) each
shard's rows are row-packed in place after loading, as `GGUFLinearMethod` packs a whole layer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from pagellm.ops.reference import GGUF_BLOCK_ELEMS, GGUF_QTYPES, gguf_dequantize, gguf_row_bytes
from pagellm.quantization.base import LinearMethodBase, new_linear_param
from pagellm.quantization import gguf_op
from pagellm.quantization.gguf_op import supported_gguf_types
from pagellm.quantization.gguf_packing import PACKED_FLAG, pack_rows, packing_pays_off, unpack_rows
from pagellm.weight_utils import OutputShard, WeightShapeError


class ShardSegment(NamedTuple):
    """One shard of the merged layer: its block type, output rows [first_row, first_row + rows) and where its
    rows of blocks sit in the flat qweight (bytes [byte_offset, byte_offset + rows * row_bytes))."""

    qtype: int
    first_row: int
    rows: int
    byte_offset: int
    row_bytes: int


class GGUFMixedLinearMethod(LinearMethodBase):
    """`shard_types`: the layer's shard id ("q", "k", "v" / 0, 1) -> GGUF block type name. qweight: uint8
    [sum over shards of rows * row_bytes], a parameter without an output dim, loaded shard by shard."""

    def __init__(self, shard_types: dict[Any, str]) -> None:
        bad = {sid: t for sid, t in shard_types.items() if t not in GGUF_QTYPES}
        if bad:
            sid, t = next(iter(bad.items()))
            raise ValueError(f"shard {sid!r}: GGUF type {t!r} is not supported natively; supported: "
                             f"{supported_gguf_types()}")
        self.shard_types = dict(shard_types)
        self.segments: list[ShardSegment] = []
        self.params_dtype: torch.dtype | None = None
        self.packed = False  # every shard's rows row-packed (gguf_packing), after loading

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int], output_size: int,
                       params_dtype: torch.dtype, bias: bool, **extra: Any) -> None:
        name = getattr(layer, "prefix", "") or "merged layer"
        plan = getattr(layer, "tp_plan", None)
        if plan is not None and plan.mode == "row":  # merged layers are column-parallel (their rows split)
            raise ValueError(f"{name}: a GGUF layer of mixed block types cannot be row-parallel")
        shard_ids = list(getattr(layer, "shard_offsets", {}))
        if len(shard_ids) != len(output_partition_sizes) or set(shard_ids) != set(self.shard_types):
            raise ValueError(f"{name}: shard types are given for {sorted(map(str, self.shard_types))}, the layer's "
                             f"shards are {shard_ids}")
        self.params_dtype = params_dtype
        first_row = byte_offset = 0
        for shard_id, rows in zip(shard_ids, output_partition_sizes):
            type_name = self.shard_types[shard_id]
            qtype = GGUF_QTYPES[type_name]
            if input_size % GGUF_BLOCK_ELEMS[qtype]:
                raise ValueError(f"{name}: in_features={input_size} is not a multiple of "
                                 f"{GGUF_BLOCK_ELEMS[qtype]}, the {type_name} block size of shard {shard_id!r}")
            row_bytes = gguf_row_bytes(qtype, input_size)
            self.segments.append(ShardSegment(qtype, first_row, rows, byte_offset, row_bytes))
            first_row, byte_offset = first_row + rows, byte_offset + rows * row_bytes
        layer.register_parameter("qweight", new_linear_param((byte_offset,), torch.uint8, extra, output_dim=None,
                                                             shard_loader=self._load_shard))
        if bias:
            layer.register_parameter("bias", new_linear_param((output_size,), params_dtype, extra))

    def _load_shard(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard: OutputShard | None) -> None:
        if shard is None:
            raise WeightShapeError("a merged GGUF layer of mixed block types loads shard by shard (q/k/v, "
                                   "gate/up), not as one merged tensor")
        seg = self.segments[shard.index]
        if loaded_weight.dtype != torch.uint8 or tuple(loaded_weight.shape) != (seg.rows, seg.row_bytes):
            raise WeightShapeError(f"shard {shard.shard_id!r}: expected uint8 blocks [{seg.rows}, {seg.row_bytes}], "
                                   f"got {loaded_weight.dtype} {list(loaded_weight.shape)}")
        param.data[seg.byte_offset : seg.byte_offset + seg.rows * seg.row_bytes].copy_(loaded_weight.reshape(-1))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight = layer.qweight
        if (gguf_op.gguf_linear_op is gguf_op.reference_gguf_linear
                or not packing_pays_off(qweight.device, self.params_dtype)):
            return
        for seg in self.segments:
            blocks = self.shard_blocks(layer, seg)
            blocks.copy_(pack_rows(blocks, seg.qtype))
        if hasattr(qweight, "weight_loader"):
            del qweight.weight_loader  # weight updates would write file-layout rows into packed groups
        self.packed = True

    def shard_blocks(self, layer: nn.Module, seg: ShardSegment) -> torch.Tensor:
        """uint8 [rows, row_bytes]: the blocks of one shard (a view of qweight)."""
        return layer.qweight[seg.byte_offset : seg.byte_offset + seg.rows * seg.row_bytes].view(seg.rows, seg.row_bytes)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """float32 [out_features, in_features]: the layer's weight, shard by shard as gguf-py dequantizes it."""
        blocks = [self.shard_blocks(layer, s) for s in self.segments]
        if self.packed:
            blocks = [unpack_rows(b, s.qtype) for b, s in zip(blocks, self.segments)]
        return torch.cat([gguf_dequantize(b, s.qtype, layer.in_features) for b, s in zip(blocks, self.segments)])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        k, n = layer.in_features, layer.out_features
        out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
        out2d, x2d = out.view(-1, n), x.reshape(-1, k)
        for seg in self.segments:
            rows = slice(seg.first_row, seg.first_row + seg.rows)
            gguf_op.gguf_linear_op(out2d[:, rows], x2d, self.shard_blocks(layer, seg),
                                   seg.qtype | (PACKED_FLAG if self.packed else 0), k,
                                   None if bias is None else bias[rows])
        return out
