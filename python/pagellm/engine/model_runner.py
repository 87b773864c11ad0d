"""SchedulerOutput -> tensors -> model forward -> logits of the rows that sample.

Per step: apply the scheduler's copy-on-write block copies, build `AttentionMetadata`, `plan()` the
attention backend once, run the model with a `ForwardContext`, then compute logits only for the
sampling rows (`logits_indices`), plus every position of the prompt chunks whose request asked
for prompt logprobs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from pagellm import ops
from pagellm.attention.base import AttentionMetadata, BaseAttentionBackend
from pagellm.logger import init_logger
from pagellm.ops import reference

logger = init_logger(__name__)


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_mapping: torch.Tensor) -> None:
    """Copy block src -> dst in every layer's key and value cache; block_mapping: int64 [num_pairs, 2]."""
    # a build without the compiled ops still runs the engine, on the pure-torch reference
    copy = ops.copy_blocks if ops.ops_available()[0] else reference.copy_blocks
    copy([k for k, _ in kv_caches], [v for _, v in kv_caches], block_mapping)


@dataclass
class ModelRunnerOutput:
    logits: torch.Tensor  # model dtype [num_sampling, V], row order = logits_indices order
    # row index (in the scheduler output) -> [num_scheduled_tokens, V] logits of the chunk (model dtype)
    prompt_logits: dict[int, torch.Tensor]


FUSED_DECODE_ENV = "PAGELLM_FUSED_DECODE"  # "0" turns the fused decode path off (for A/B tests)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attn_backend: BaseAttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 fused_decode: bool | None = None) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        if fused_decode is None:
            fused_decode = os.environ.get(FUSED_DECODE_ENV, "1") != "0"
        # Decode-only steps run each decoder layer as one C++ op (same kernels, same order, same
        # results): the per-op Python cost is a third of a batch-1 step on a small model.
        self.fused_decode = bool(fused_decode and getattr(model, "supports_fused_decode", False)
                                 and attn_backend.supports_fused_decode_layer)

    def use_fused_decode(self, md: AttentionMetadata) -> bool:
        """A decode-only step (one token per request, nothing padded) with the fused path enabled."""
        return self.fused_decode and 0 < md.num_reqs == md.num_decode_reqs == md.num_tokens

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        """A scheduler-output array (already the right dtype, C-contiguous) as a tensor on the model's device."""
        t = torch.from_numpy(arr)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def build_metadata(self, sched_out) -> AttentionMetadata:
        num_reqs = sched_out.num_reqs
        return AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=sched_out.total_num_scheduled_tokens,
            num_decode_reqs=sched_out.num_decode_reqs,
            max_query_len=int(sched_out.num_scheduled_tokens.max()) if num_reqs else 0,
            max_seq_len=int(sched_out.seq_lens.max()) if num_reqs else 0,
            slot_mapping=self._to_device(sched_out.slot_mapping),
            block_tables=self._to_device(sched_out.block_tables),
            seq_lens=self._to_device(sched_out.seq_lens),
            query_start_loc=self._to_device(sched_out.query_start_loc),
        )

    @torch.inference_mode()
    def execute(self, sched_out, prompt_logprob_rows: list[int] | None = None) -> ModelRunnerOutput:
        from pagellm.models.context import ForwardContext  # noqa: PLC0415

        cow_copies = sched_out.cow_copies
        if len(cow_copies):
            copy_blocks(self.kv_caches, self._to_device(cow_copies))

        metadata = self.build_metadata(sched_out)
        self.attn_backend.plan(metadata)
        hidden = self.model(
            self._to_device(sched_out.input_ids), self._to_device(sched_out.positions),
            ForwardContext(attn_backend=self.attn_backend, kv_caches=self.kv_caches,
                           fused_decode=self.use_fused_decode(metadata)),
        )

        logits_indices = sched_out.logits_indices
        gather, spans = _gather_positions(logits_indices, sched_out.query_start_loc, prompt_logprob_rows or [])
        if len(gather) == 0:
            return ModelRunnerOutput(logits=hidden.new_zeros((0, 0)), prompt_logits={})
        logits = self.model.compute_logits(hidden[self._to_device(gather)])  # model dtype
        prompt_logits = {r: logits[p : p + n] for r, p, n in spans}
        return ModelRunnerOutput(logits=logits[: len(logits_indices)], prompt_logits=prompt_logits)


def _gather_positions(logits_indices: np.ndarray, query_start_loc: np.ndarray,
                      prompt_logprob_rows: list[int]) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Token positions to compute logits for: the sampling rows first, then every position of each
    prompt-logprob row's chunk. Returns them (int64) and, per such row, (row, start in gathered, length)."""
    if not prompt_logprob_rows:
        return logits_indices, []
    parts = [logits_indices]
    spans: list[tuple[int, int, int]] = []
    pos = len(logits_indices)
    for r in prompt_logprob_rows:
        start, end = int(query_start_loc[r]), int(query_start_loc[r + 1])
        parts.append(np.arange(start, end, dtype=np.int64))
        spans.append((r, pos, end - start))
        pos += end - start
    return np.concatenate(parts), spans
