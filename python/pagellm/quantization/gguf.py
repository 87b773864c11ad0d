"""GGUF quantized blocks used natively: Q8_0, Q4_0, Q4_1, Q4_K and Q6_K weights stay in the .gguf file's block
layout and are multiplied by `torch.ops.pagellm.gguf_linear` (which dequantizes in registers), so a decode step
reads the quantized bytes instead of a dequantized copy (Q4_1: 0.625 bytes per weight, Q4_K 0.5625, instead of 2
in bf16).

    LLM("model.gguf", quantization="gguf")      # or LLM(quantization="gguf") for the default model

The layer types come from the file (pagellm.model_loader.gguf_native builds the config from its tensor
types); a layer whose tensor is F32/F16/BF16 in the file stays an ordinary float layer. The token embedding
and the LM head too: the head is a `gguf_linear` over the blocks, the embedding dequantizes only the rows it
looks up, and a tied pair holds the blocks once (`GGUFEmbeddingMethod`). On a CPU with AVX-512 VNNI a
half-precision model's blocks are rearranged once after loading into gguf_linear's row-packed layout
(`gguf_packing`: 16 rows interleaved per block, the same bytes; every type, the k-quants' super-blocks too),
which its VNNI kernel streams ~2-4x faster.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.ops.reference import GGUF_BLOCK_ELEMS, GGUF_QTYPES, gguf_dequantize, gguf_row_bytes
from pagellm.quantization.gguf_packing import (
    PACKABLE_QTYPES, PACKED_FLAG, pack_rows, packing_pays_off, unpack_positions, unpack_rows,
)
from pagellm.quantization.base import EmbeddingMethodBase, LinearMethodBase, QuantizationConfig, new_linear_param
from pagellm.quantization.gguf_mixed import GGUFMixedLinearMethod
from pagellm.quantization import gguf_op
from pagellm.quantization.gguf_op import supported_gguf_types  # noqa: F401  (re-export)
from pagellm.quantization.registry import register_quantization_config
from pagellm.quantization.unquantized import UnquantizedEmbeddingMethod, UnquantizedLinearMethod

GGUF_METHOD = "gguf"

class GGUFLinearMethod(LinearMethodBase):
    """qweight uint8 [out, in / block_elems * block_bytes]: the GGUF tensor's rows as stored (one row of blocks per output
    feature), so a merged layer's shards (q/k/v, gate/up) load into their row ranges like a float weight
    (`output_dim` 0, fixed bytes per row). Optional bias [out] in the model dtype.

    After loading, on a CPU whose AVX-512 VNNI kernel runs (half-precision model), the rows are rearranged in
    place into the row-packed layout (`gguf_packing`, ~2-4x faster decode GEMVs); the parameter then loses its
    weight_loader, so in-place weight updates are refused rather than mixing layouts."""

    def __init__(self, type_name: str) -> None:
        if type_name not in GGUF_QTYPES:
            raise ValueError(f"GGUF type {type_name!r} is not supported natively; supported: {supported_gguf_types()}")
        self.type_name = type_name
        self.qtype = GGUF_QTYPES[type_name]
        self.op_qtype = self.qtype  # | PACKED_FLAG once the rows are packed
        self.params_dtype: torch.dtype | None = None

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int], output_size: int,
                       params_dtype: torch.dtype, bias: bool, **extra: Any) -> None:
        block_elems = GGUF_BLOCK_ELEMS[self.qtype]
        if input_size % block_elems:
            split = "" if getattr(layer, "tp_plan", None) is None else " per tensor-parallel rank"
            raise ValueError(f"{getattr(layer, 'prefix', '') or 'linear layer'}: in_features{split}={input_size} is "
                             f"not a multiple of {block_elems}, the {self.type_name} block size")
        row_bytes = gguf_row_bytes(self.qtype, input_size)
        self.params_dtype = params_dtype
        # a row-parallel rank takes whole blocks of each row: block_elems inputs per block_bytes bytes
        layer.register_parameter("qweight", new_linear_param(
            (output_size, row_bytes), torch.uint8, extra,
            input_units=(block_elems, gguf_row_bytes(self.qtype, block_elems))))
        if bias:
            layer.register_parameter("bias", new_linear_param((output_size,), params_dtype, extra))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight = layer.qweight
        if (gguf_op.gguf_linear_op is gguf_op.reference_gguf_linear or self.qtype not in PACKABLE_QTYPES
                or not packing_pays_off(qweight.device, self.params_dtype)):
            return
        qweight.data.copy_(pack_rows(qweight.data, self.qtype))  # in place: a tied LM head shares this Parameter
        if hasattr(qweight, "weight_loader"):
            del qweight.weight_loader  # weight updates would write file-layout rows into packed groups
        self.op_qtype = self.qtype | PACKED_FLAG

    @property
    def packed(self) -> bool:
        return self.op_qtype != self.qtype

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        k, n = layer.in_features, layer.out_features
        if x.dim() == 2:  # the decode case: as few torch calls as possible
            out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
            gguf_op.gguf_linear_op(out, x, layer.qweight, self.op_qtype, k, bias)
            return out
        m = x.numel() // k
        out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
        gguf_op.gguf_linear_op(out.view(m, n), x.reshape(m, k), layer.qweight, self.op_qtype, k, bias)
        return out


class GGUFEmbeddingMethod(GGUFLinearMethod, EmbeddingMethodBase):
    """The token embedding / LM head in GGUF blocks: qweight uint8 [vocab, hidden / block_elems * block_bytes]. The head
    is `gguf_linear` (logits in the model dtype); a lookup gathers the looked-up rows of blocks and dequantizes
    just those ([num_tokens, hidden] per step, pure torch, exactly as gguf-py), then rounds to the model dtype as
    the float path's weight was rounded when loaded. Under tensor parallelism a rank holds a block of rows of
    blocks (a zero padding row is a zero block: d = 0)."""

    vocab_parallel = True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        if self.packed:  # a buffer: a declared constant of captured steps, as the weight is
            layer.register_buffer("qweight_unpack_positions", unpack_positions(
                self.qtype, layer.qweight.shape[1], layer.qweight.device), persistent=False)

    def embedding(self, layer: nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
        if self.packed:
            rows = unpack_rows(layer.qweight, self.qtype, token_ids, layer.qweight_unpack_positions)
        else:
            rows = layer.qweight.index_select(0, token_ids.reshape(-1))
        values = gguf_dequantize(rows, self.qtype, layer.in_features).to(self.params_dtype)
        return values.view(token_ids.shape + (layer.in_features,))


@register_quantization_config(GGUF_METHOD)
class GGUFConfig(QuantizationConfig):
    """`layer_types`: layer name (its prefix, e.g. "model.layers.0.self_attn.qkv_proj", "model.embed_tokens",
    "lm_head") -> GGUF block type ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"), or for a merged layer whose shards
    are stored in different types, shard id -> type ({"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"}:
    `GGUFMixedLinearMethod`); layers not listed are unquantized (float in the file, or a block type without a
    native kernel, dequantized by the loader)."""

    def __init__(self, layer_types: dict[str, str | dict]) -> None:
        for name, t in layer_types.items():
            for shard_type in (t.values() if isinstance(t, dict) else [t]):
                if shard_type not in GGUF_QTYPES:
                    raise ValueError(f"{name}: GGUF type {shard_type!r} is not supported natively; supported: "
                                     f"{supported_gguf_types()}")
        self.layer_types = dict(layer_types)

    @classmethod
    def get_name(cls) -> str:
        return GGUF_METHOD

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GGUFConfig":
        layer_types = config.get("layer_types")
        if not isinstance(layer_types, dict) or not layer_types:
            raise ValueError("quantization='gguf' multiplies a .gguf file's quantized blocks natively: load a .gguf "
                             "model (LLM('model.gguf', quantization='gguf'), or LLM(quantization='gguf') for the "
                             "default model); this checkpoint lists no GGUF layer types")
        return cls(layer_types)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        type_name = self.layer_types.get(prefix)
        if isinstance(type_name, dict):
            return GGUFMixedLinearMethod(type_name)
        return UnquantizedLinearMethod() if type_name is None else GGUFLinearMethod(type_name)

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> EmbeddingMethodBase:
        type_name = self.layer_types.get(prefix)
        return UnquantizedEmbeddingMethod() if type_name is None else GGUFEmbeddingMethod(type_name)
