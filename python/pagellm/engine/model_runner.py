"""SchedulerOutput -> tensors -> model forward -> logits of the rows that sample.

Per step: apply the scheduler's copy-on-write block copies, build `AttentionMetadata`, `plan()` the
attention backend once, run the model with a `ForwardContext`, then compute logits only for the
sampling rows (`logits_indices`), plus every position of the prompt chunks whose request asked
for prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.base import AttentionMetadata, BaseAttentionBackend
from pagellm.logger import init_logger

logger = init_logger(__name__)


def _copy_blocks_reference(kv_caches, mapping: torch.Tensor) -> None:
    """Copy block src -> dst in every layer's key and value cache, pairs in order."""
    pairs = mapping.tolist()
    for k, v in kv_caches:
        for src, dst in pairs:
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], mapping: torch.Tensor) -> None:
    """pagellm.ops.copy_blocks when the compiled ops are available, else the reference above."""
    try:
        from pagellm import ops  # noqa: PLC0415

        ok = ops.ops_available()[0] if hasattr(ops, "ops_available") else hasattr(ops, "copy_blocks")
    except Exception:  # ops package not importable (extension missing)
        ok = False
    if not ok:
        _copy_blocks_reference(kv_caches, mapping)
        return
    ops.copy_blocks([k for k, _ in kv_caches], [v for _, v in kv_caches], mapping)


def _field(out, name: str, default=None):
    val = getattr(out, name, default)
    return val() if callable(val) else val


@dataclass
class ModelRunnerOutput:
    logits: torch.Tensor  # float32 [num_sampling, V], row order = logits_indices order
    # row index (in the scheduler output) -> float32 [num_scheduled_tokens, V] logits of the chunk
    prompt_logits: dict[int, torch.Tensor]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attn_backend: BaseAttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.device = torch.device(device)

    def _t(self, arr, dtype) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(np.asarray(arr))).to(dtype)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def build_metadata(self, out) -> AttentionMetadata:
        num_sched = np.asarray(out.num_scheduled_tokens)
        seq_lens = np.asarray(out.seq_lens)
        bt = np.asarray(out.block_tables)
        num_reqs = len(num_sched)
        if bt.ndim == 1:
            width = int(_field(out, "max_blocks_in_batch", 0) or (bt.size // max(num_reqs, 1)))
            bt = bt.reshape(num_reqs, width)
        return AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=int(num_sched.sum()),
            num_decode_reqs=int(_field(out, "num_decode_reqs", 0)),
            max_query_len=int(num_sched.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            slot_mapping=self._t(out.slot_mapping, torch.int64),
            block_tables=self._t(bt, torch.int32),
            seq_lens=self._t(seq_lens, torch.int32),
            query_start_loc=self._t(out.query_start_loc, torch.int32),
        )

    @torch.inference_mode()
    def execute(self, out, prompt_logprob_rows: list[int] | None = None) -> ModelRunnerOutput:
        from pagellm.models.context import ForwardContext  # noqa: PLC0415

        cow = np.asarray(_field(out, "cow_copies", np.zeros((0, 2))))
        if cow.size:
            copy_blocks(self.kv_caches, self._t(cow.reshape(-1, 2), torch.int64))

        md = self.build_metadata(out)
        self.attn_backend.plan(md)
        input_ids = self._t(out.input_ids, torch.int64)
        positions = self._t(out.positions, torch.int64)
        hidden = self.model(input_ids, positions, ForwardContext(attn_backend=self.attn_backend, kv_caches=self.kv_caches))

        logits_idx = np.asarray(out.logits_indices, dtype=np.int64)
        idx_parts = [logits_idx]
        spans: list[tuple[int, int, int]] = []  # (row, start in gathered, length)
        if prompt_logprob_rows:
            qsl = np.asarray(out.query_start_loc)
            pos = len(logits_idx)
            for r in prompt_logprob_rows:
                s, e = int(qsl[r]), int(qsl[r + 1])
                idx_parts.append(np.arange(s, e, dtype=np.int64))
                spans.append((r, pos, e - s))
                pos += e - s
        gather = np.concatenate(idx_parts) if len(idx_parts) > 1 else logits_idx
        if len(gather) == 0:
            return ModelRunnerOutput(logits=hidden.new_zeros((0, 0), dtype=torch.float32), prompt_logits={})
        logits = self.model.compute_logits(hidden[self._t(gather, torch.int64)]).float()
        prompt_logits = {r: logits[p : p + n] for r, p, n in spans}
        return ModelRunnerOutput(logits=logits[: len(logits_idx)], prompt_logits=prompt_logits)
