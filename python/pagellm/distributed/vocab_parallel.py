"""Vocabulary-parallel embedding and LM head: rank r holds rows [start, start + held) of W [V, hidden],
zero-padded to ceil(V/tp) rows (sharding.vocab_range) so every rank's block has one shape.

    embedding  each rank looks up the ids it holds (others read row 0 and are zeroed), an all-reduce sums
               the ranks' rows: every id comes from exactly one rank
    LM head    each rank's logits for its rows, all-gathered in rank order, the padding cut off
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.distributed.communication import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from pagellm.distributed.parallel_state import get_tp_state
from pagellm.distributed.sharding import narrow_padded, vocab_range


@dataclass(frozen=True)
class VocabShard:
    """Rows [start, start + held) of a `vocab_size`-row weight, stored in `padded` rows."""

    vocab_size: int
    start: int
    held: int
    padded: int

    def load(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """weight_loader: copy this rank's rows of the full checkpoint tensor (zero padding after them)."""
        from pagellm.weight_utils import load_output_slice  # noqa: PLC0415

        if shard_id is not None:
            raise ValueError(f"parameter does not take shards (got shard_id={shard_id!r})")
        if loaded_weight.shape[0] == self.vocab_size:  # else the shape-checked copy reports the mismatch
            loaded_weight = narrow_padded(loaded_weight, 0, self.start, self.held, self.padded)
        getattr(param, "shard_loader", load_output_slice)(param, loaded_weight, None)


def plan_vocab(vocab_size: int, quant_config, embedding_method, prefix: str) -> VocabShard | None:
    """This rank's VocabShard; None on a single rank. A quantized method whose stored rows are not the
    vocabulary's (not `vocab_parallel`) + TP: ValueError."""
    state = get_tp_state()
    if state.size == 1:
        return None
    if embedding_method is not None and not embedding_method.vocab_parallel:
        raise ValueError(f"{prefix}: {type(embedding_method).__name__} does not store the vocabulary by rows, so "
                         f"tensor parallelism cannot split it")
    start, held, padded = vocab_range(vocab_size, state.rank, state.size)
    return VocabShard(vocab_size, start, held, padded)


def vocab_parallel_embedding(layer, shard: VocabShard, token_ids: torch.Tensor) -> torch.Tensor:
    """token ids [...] -> [..., hidden], summed over the ranks."""
    held = (token_ids >= shard.start) & (token_ids < shard.start + shard.held)
    local_ids = torch.where(held, token_ids - shard.start, torch.zeros_like(token_ids))
    rows = layer.linear_method.embedding(layer, local_ids).masked_fill(~held.unsqueeze(-1), 0)
    return tensor_model_parallel_all_reduce(rows)


def vocab_parallel_logits(layer, shard: VocabShard, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., hidden] -> logits [..., vocab_size] (every rank gets all of them)."""
    local = layer.linear_method.apply(layer, hidden)
    return tensor_model_parallel_all_gather(local, dim=-1)[..., : shard.vocab_size]
