"""The quantization seam: how a weight format is created, loaded and multiplied.

A format is a `QuantizationConfig` (parsed from the checkpoint's `quantization_config`, registered by
name in `registry.py`) that hands every linear layer a `LinearMethodBase`. The layer
(`pagellm.layers.linear.Linear` and its merged variants) owns the logical shape [out, in] and the
output shards (q/k/v, gate/up); the method owns the tensors:

    create_weights(layer, ...)           register parameters on the layer, each with a `weight_loader`
    <checkpoint tensors load>            layer.weight_loader -> param.shard_loader(param, tensor, OutputShard)
    process_weights_after_loading(layer) repack / transpose / derive, once, after every tensor loaded
    apply(layer, x, bias)                x [..., in] -> [..., out]

Loading a merged layer: the model maps an HF name (`...q_proj.weight_scale`) to the merged parameter
(`...qkv_proj.weight_scale`) plus a shard id ("q"); the layer turns the shard id into an `OutputShard`
(rows [offset, offset + size) of the logical [out, in] weight) and calls the parameter's `shard_loader`
(default `load_output_slice`: narrow `param.output_dim` by the shard, dividing by
`param.output_pack_factor` when elements are packed along the output dim). So a weight packed along
`in`, or per-output-row scales, need only `output_dim`; anything else gives its own `shard_loader`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch
from torch import nn

from pagellm.weight_utils import OutputShard, WeightShapeError, load_output_slice, set_weight_attrs

# (param, checkpoint tensor, its shard or None for the whole tensor) -> None
ShardLoader = Callable[[nn.Parameter, torch.Tensor, "OutputShard | None"], None]


def new_linear_param(shape: tuple[int, ...], dtype: torch.dtype, extra: dict[str, Any], *, output_dim: int | None = 0,
                     output_pack_factor: int = 1, input_dim: int | None = 1, input_units: tuple[int, int] = (1, 1),
                     shard_loader: ShardLoader | None = None) -> nn.Parameter:
    """An uninitialised, frozen parameter carrying the layer's `extra` attributes (its `weight_loader`)
    and where its output dim is (None: not split by output shards; then give a `shard_loader`).

    `input_dim` / `input_units` say how a row-parallel layer (distributed.parallel_linear) cuts the checkpoint
    tensor by input features: along `input_dim` (None, and always for a 1-D parameter: kept whole on every
    rank), `input_units = (elements, stored)` input features per `stored` entries (a group's one scale:
    (group_size, 1); a GGUF block: (32, 34))."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    attrs = dict(extra, output_dim=output_dim, output_pack_factor=output_pack_factor,
                 input_dim=input_dim if len(shape) >= 2 else None, input_units=tuple(input_units))
    if shard_loader is not None:
        attrs["shard_loader"] = shard_loader
    set_weight_attrs(param, attrs)
    return param


class LinearMethodBase(ABC):
    """How one linear layer's weight is stored, loaded and applied. One instance per layer."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int], output_size: int,
                       params_dtype: torch.dtype, bias: bool, **extra: Any) -> None:
        """Register the layer's parameters (`layer.register_parameter`), uninitialised.

        The logical weight is [output_size, input_size] with output_size = sum(output_partition_sizes)
        (one entry per checkpoint shard of a merged layer). `params_dtype` is the model dtype
        (activations, and what an unquantized weight would be stored in). When `bias` is True the
        method registers `layer.bias` [output_size] (the layer passes it to `apply`).
        Every parameter must carry the attributes in `extra` (at least `weight_loader`; see
        `new_linear_param`) and, if it is split by output shards, `output_dim`.
        """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every checkpoint tensor has loaded: repack, transpose, precompute. Default: nothing."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T (+ bias): x [..., input_size] in the model dtype -> [..., output_size] in the same dtype."""


class EmbeddingMethodBase(LinearMethodBase):
    """How a vocabulary-sized weight W [num_embeddings, embedding_dim] is stored, looked up and multiplied.

    The input embedding and the LM head are this one weight seen two ways: W is a linear's [out, in] with
    out = num_embeddings (the vocabulary) and in = embedding_dim (hidden), so `create_weights` / `apply` are
    the LinearMethodBase ones (`apply`: hidden [..., in] -> logits [..., num_embeddings] in the model dtype),
    and `embedding` reads rows of it. A tied LM head shares its embedding's method and parameters (one copy
    of W in memory), so a method must not replace parameters in `process_weights_after_loading`.

    `vocab_parallel`: True when every stored tensor is [num_embeddings, ...] with token i's data in row i and
    an all-zero row reads as a zero vector, so a tensor-parallel rank can hold a zero-padded block of rows
    (distributed.vocab_parallel); a method storing W otherwise leaves it False and is refused under TP.
    """

    vocab_parallel: bool = False

    @abstractmethod
    def embedding(self, layer: nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [...] (int64 or int32) -> [..., embedding_dim] in the model dtype: the rows of W, as the
        float path would hold them. Called inside captured steps: only tensor ops, no reads into Python."""

    def apply_argmax(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, embedding_dim] -> int64 [M]: `apply(layer, x).argmax(-1)` exactly (the first maximum of the
        logits as `apply` rounds them; a NaN counts as the maximum), for greedy rows that need no logits. None
        (the default): this method has no such path, the caller computes the logits."""
        return None


class QuantizationConfig(ABC):
    """A weight format: parsed once from the checkpoint's `quantization_config` dict, then asked by each
    linear layer for its LinearMethod (a format may leave some layers unquantized by `prefix`)."""

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The registry name, as in the checkpoint's `quantization_config.quant_method`."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> "QuantizationConfig":
        """From the checkpoint's `quantization_config` ({} when it has none). Bad values -> ValueError."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        """The method for the linear layer named `prefix` (e.g. "model.layers.0.self_attn.qkv_proj")."""

    def check_checkpoint(self, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        """Called before the model is built with every checkpoint tensor's (safetensors dtype name such as
        "I32", shape) by HF name, read from the file headers: refuse a checkpoint this format cannot load
        (ValueError naming the tensor) before memory is committed. Default: nothing to check."""

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> EmbeddingMethodBase | None:
        """The method for a vocabulary-sized layer named `prefix`: the input embedding ("model.embed_tokens",
        whose method a tied LM head shares) or an untied LM head ("lm_head"). None (the default): unquantized,
        W in the model dtype (`UnquantizedEmbeddingMethod`), as AutoAWQ and LLM.int8() leave them; a format
        that stores them otherwise overrides this."""
        return None


__all__ = [
    "EmbeddingMethodBase", "LinearMethodBase", "OutputShard", "QuantizationConfig", "ShardLoader", "WeightShapeError", "load_output_slice",
    "new_linear_param", "set_weight_attrs",
]
