"""The default LinearMethod (and EmbeddingMethod): the weight as in the checkpoint, [out, in] in the model dtype."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.ops.linear_dispatch import linear, linear_argmax
from pagellm.ops.row_dispatch import embedding
from pagellm.quantization.base import EmbeddingMethodBase, LinearMethodBase, new_linear_param


class UnquantizedLinearMethod(LinearMethodBase):
    """weight [out, in] (+ bias [out]) in `params_dtype`; apply = `pagellm.layers.linear.linear`, which picks
    pagellm's CPU kernels (linear_small_m for fp32 and bf16, AMX tiles for some bf16 row counts) or F.linear."""

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int], output_size: int,
                       params_dtype: torch.dtype, bias: bool, **extra: Any) -> None:
        layer.register_parameter("weight", new_linear_param((output_size, input_size), params_dtype, extra))
        if bias:
            layer.register_parameter("bias", new_linear_param((output_size,), params_dtype, extra))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, layer.weight, bias)


class UnquantizedEmbeddingMethod(UnquantizedLinearMethod, EmbeddingMethodBase):
    """weight [num_embeddings, embedding_dim] in `params_dtype`: looked up as F.embedding (on the CPU with
    pagellm's gather_rows, no OpenMP region), multiplied as a linear."""

    vocab_parallel = True

    def embedding(self, layer: nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
        return embedding(token_ids, layer.weight)

    def apply_argmax(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return linear_argmax(x, layer.weight)
