"""Token embedding and LM head (optionally tied to the embedding), stored as an EmbeddingMethod says.

Both are views of one vocabulary-sized weight W [num_embeddings, embedding_dim], which a LinearMethod sees
as a linear's [out, in] (`out_features` = vocabulary, `in_features` = hidden). `quant_config` (None =
unquantized, W in the model dtype) picks the method by `prefix` (`get_embedding_method`, None there:
unquantized too); a tied head shares the embedding's method and parameters, so the weight is held once
whatever its format.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from pagellm.distributed.vocab_parallel import (
    VocabShard,
    plan_vocab,
    vocab_parallel_embedding,
    vocab_parallel_logits,
)
from pagellm.quantization.base import EmbeddingMethodBase, QuantizationConfig
from pagellm.quantization.unquantized import UnquantizedEmbeddingMethod
from pagellm.weight_utils import load_output_slice


def _load_whole(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """The vocabulary layers' weight_loader: one checkpoint tensor per parameter, through its shard_loader."""
    if shard_id is not None:
        raise ValueError(f"parameter does not take shards (got shard_id={shard_id!r})")
    getattr(param, "shard_loader", load_output_slice)(param, loaded_weight, None)


class _VocabWeight(nn.Module):
    """W [num_embeddings, embedding_dim], its parameters registered by the method the config picks. Under
    tensor parallelism (`vocab_shard` set) this rank holds its block of rows (pagellm.distributed.vocab_parallel):
    out_features is then the block's padded row count, num_embeddings stays the vocabulary size."""

    vocab_shard: VocabShard | None = None

    def _create_weights(self, num_embeddings: int, embedding_dim: int, dtype, device,
                        quant_config: QuantizationConfig | None, prefix: str) -> None:
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.in_features, self.out_features = embedding_dim, num_embeddings  # what a LinearMethod reads
        self.prefix = prefix
        method = None if quant_config is None else quant_config.get_embedding_method(self, prefix)
        self.linear_method: EmbeddingMethodBase = UnquantizedEmbeddingMethod() if method is None else method
        self.vocab_shard = plan_vocab(num_embeddings, quant_config, method, prefix)
        rows, loader = num_embeddings, _load_whole
        if self.vocab_shard is not None:
            rows, loader = self.vocab_shard.padded, self.vocab_shard.load
            self.out_features = rows
        params_dtype = dtype if dtype is not None else torch.get_default_dtype()
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.linear_method.create_weights(self, embedding_dim, [rows], rows, params_dtype,
                                              False, weight_loader=loader)
        for name, p in self._parameters.items():
            if p is not None and not hasattr(p, "weight_loader"):
                raise TypeError(f"{type(self.linear_method).__name__}.create_weights registered {name!r} "
                                f"without a weight_loader")

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, linear_method={type(self.linear_method).__name__}"


class VocabEmbedding(_VocabWeight):
    """token ids [...] -> [..., embedding_dim] in the model dtype (the method's `embedding`: a float W is
    indexed, a quantized one dequantizes only the rows looked up)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None, device=None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "model.embed_tokens") -> None:
        super().__init__()
        self._create_weights(num_embeddings, embedding_dim, dtype, device, quant_config, prefix)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_shard is not None:
            return vocab_parallel_embedding(self, self.vocab_shard, input_ids)
        return self.linear_method.embedding(self, input_ids)


class LMHead(_VocabWeight):
    """logits = hidden @ W^T in the model dtype (as HF's lm_head); the sampler widens to float32 only where
    it computes more than an argmax. `tied_to`: the embedding whose W (method and parameters) it shares;
    otherwise its own W, in the format `quant_config` gives `prefix`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None, device=None,
                 tied_to: VocabEmbedding | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "lm_head") -> None:
        super().__init__()
        self.tied = tied_to is not None
        if tied_to is None:
            self._create_weights(num_embeddings, embedding_dim, dtype, device, quant_config, prefix)
            return
        if (tied_to.num_embeddings, tied_to.embedding_dim) != (num_embeddings, embedding_dim):
            raise ValueError(f"tied LM head [{num_embeddings}, {embedding_dim}] differs from its embedding "
                             f"[{tied_to.num_embeddings}, {tied_to.embedding_dim}]")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.in_features, self.out_features = embedding_dim, tied_to.out_features
        self.prefix = prefix
        self.vocab_shard = tied_to.vocab_shard  # the embedding's rows of W: the same shard
        self.linear_method = tied_to.linear_method
        for name, p in tied_to.named_parameters(recurse=False):
            self.register_parameter(name, p)  # the same Parameter objects: one copy, loaded once

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., embedding_dim] -> logits [..., num_embeddings] in hidden's dtype."""
        if self.vocab_shard is not None:
            return vocab_parallel_logits(self, self.vocab_shard, hidden)
        return self.linear_method.apply(self, hidden)

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, embedding_dim] -> int64 [N] = forward(hidden).argmax(-1) (torch's rule: the first maximum),
        from the method's fused head where it has one (no [N, vocabulary] logits); None where it has not, or under
        tensor parallelism (each rank holds a block of the vocabulary): then the caller computes the logits."""
        if self.vocab_shard is not None:
            return None
        return self.linear_method.apply_argmax(self, hidden)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tied={self.tied}"
