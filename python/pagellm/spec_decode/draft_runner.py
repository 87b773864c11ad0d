"""The draft model's own paged KV cache and forward, for the `draft_model` proposer (draft_model.py).

The draft runs through the engine's own machinery: its blocks come from a `pagellm._C.BlockManager`
(the class the scheduler uses), its cache is a `KVCaches` sized like the target's, and each forward is
a `ModelRunner.execute` over a `DraftBatch`: the SchedulerOutput fields the runner reads, built here
from (sequence, tokens, first position) rows. Pure decode batches (the k greedy steps) replay a step
graph on CPU like the target's decode steps do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pagellm.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class DraftRow:
    """One sequence's tokens in a draft forward: `token_ids` at positions start .. start + len - 1.
    `want_next`: the greedy token after the row's last position is wanted."""

    seq_id: str
    token_ids: Sequence[int]
    start: int
    want_next: bool


@dataclass
class DraftBatch:
    """The SchedulerOutput fields `ModelRunner.execute` reads, for a draft forward. Rows are ordered
    decodes first (one token each), as the attention backends expect."""

    request_ids: list[str]
    num_scheduled_tokens: np.ndarray  # int32 [R]
    query_start_loc: np.ndarray  # int32 [R + 1]
    seq_lens: np.ndarray  # int32 [R]
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int32 [R, max blocks], 0-padded
    logits_indices: np.ndarray  # int64: the last token of each row that wants its next token, in row order
    logits_seq_ids: list[str]  # the sequences of those rows (logits row i -> logits_seq_ids[i])
    cow_copies: np.ndarray  # int64 [C, 2] (src, dst) block copies to apply first
    num_decode_reqs: int
    total_num_scheduled_tokens: int

    @property
    def num_reqs(self) -> int:
        return len(self.request_ids)


def build_draft_batch(rows: Sequence[DraftRow], block_tables: dict[str, list[int]], block_size: int,
                      cow_copies: Sequence[tuple[int, int]] = ()) -> DraftBatch:
    """The batch of `rows` (reordered decodes first) over the given block tables (seq_id -> block ids,
    covering every row's positions)."""
    rows = sorted(rows, key=lambda r: len(r.token_ids) != 1)  # stable: decodes first
    counts = np.array([len(r.token_ids) for r in rows], dtype=np.int32)
    qsl = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(counts, out=qsl[1:])
    positions = np.concatenate([np.arange(r.start, r.start + len(r.token_ids), dtype=np.int64) for r in rows])
    width = max(len(block_tables[r.seq_id]) for r in rows)
    tables = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        tables[i, : len(block_tables[r.seq_id])] = block_tables[r.seq_id]
    row_of_token = np.repeat(np.arange(len(rows)), counts)
    slots = tables[row_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return DraftBatch(
        request_ids=[r.seq_id for r in rows],
        num_scheduled_tokens=counts,
        query_start_loc=qsl,
        seq_lens=np.array([r.start + len(r.token_ids) for r in rows], dtype=np.int32),
        input_ids=np.fromiter((t for r in rows for t in r.token_ids), dtype=np.int64, count=int(qsl[-1])),
        positions=positions,
        slot_mapping=slots,
        block_tables=tables,
        logits_indices=np.array([qsl[i + 1] - 1 for i, r in enumerate(rows) if r.want_next], dtype=np.int64),
        logits_seq_ids=[r.seq_id for r in rows if r.want_next],
        cow_copies=np.asarray(cow_copies, dtype=np.int64).reshape(-1, 2),
        num_decode_reqs=int((counts == 1).sum()),
        total_num_scheduled_tokens=int(qsl[-1]),
    )


class DraftRunner:
    """A draft model with its own paged KV cache and block manager; `forward` runs rows and returns the
    greedy next token of the rows that want one. The caller owns the block tables' contents (what
    each sequence's cached positions hold) and allocates slots before a forward."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device | str, block_size: int, num_blocks: int,
                 kv_cache_dtype, max_model_len: int, max_num_seqs: int, enable_prefix_caching: bool,
                 attention_backend: str | None = None, enforce_eager: bool = False) -> None:
        from pagellm import _C  # noqa: PLC0415
        from pagellm.attention import select_attention_backend  # noqa: PLC0415
        from pagellm.engine.model_runner import ModelRunner  # noqa: PLC0415
        from pagellm.kv_cache import allocate_kv_caches, make_kv_cache_config  # noqa: PLC0415

        self.device = torch.device(device)
        self.model = model
        # raises ValueError when num_blocks cannot hold one max_model_len sequence
        self.kv_cache_config = make_kv_cache_config(model.kv_cache_specs(block_size, kv_cache_dtype), self.device,
                                                    max_model_len, max_num_seqs, num_blocks_override=num_blocks,
                                                    free_sliding_blocks=False)  # its BlockManager keeps one table
        self.kv_caches = allocate_kv_caches(self.kv_cache_config, self.device)
        # no watermark: the draft admits whatever fits (a sequence that does not fit just gets no drafts)
        self.block_manager = _C.BlockManager(self.kv_cache_config.num_blocks, block_size, enable_prefix_caching, 0.0)
        self.block_size = block_size
        self.attn_backend = select_attention_backend(attention_backend, self.device)
        self.runner = ModelRunner(model, self.attn_backend, self.kv_caches, self.device,
                                  use_step_graph=False if enforce_eager else None)
        self._sleep_state = None  # engine/sleep.py's SleepingState while the engine sleeps

    def sleep(self, level: int) -> int:
        """Free the draft's KV cache (level 2: its own weights too, saved first; storages a self-draft shares
        with the target are already freed by the target's worker and skipped). Returns the measured bytes."""
        from pagellm.engine.sleep import put_to_sleep  # noqa: PLC0415

        if self._sleep_state is not None:
            raise RuntimeError(f"the draft is already asleep (level {self._sleep_state.level})")
        weights = list(self.model.parameters()) + list(self.model.buffers()) if level == 2 else []
        self._sleep_state = put_to_sleep(level, self.kv_caches.tensors(), weights, self.device)
        return self._sleep_state.freed_bytes

    def wake_up(self) -> None:
        """Restore what sleep freed (a zeroed KV cache, the saved weights); a no-op when awake. Call it after
        the target's workers woke: a self-draft's shared weights are theirs to restore."""
        from pagellm.engine.sleep import wake_from_sleep  # noqa: PLC0415

        if self._sleep_state is not None:
            wake_from_sleep(self._sleep_state)
            self._sleep_state = None
            self.runner.invalidate_step_graphs()  # storages were reallocated

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_config.num_blocks

    def forward(self, rows: Sequence[DraftRow]) -> dict[str, int]:
        """Write the rows' K/V into the draft cache; seq_id -> greedy next token for rows with `want_next`."""
        if not rows:
            return {}
        bm = self.block_manager
        tables = {r.seq_id: bm.get_block_table(r.seq_id) for r in rows}
        batch = build_draft_batch(rows, tables, self.block_size, bm.take_cow_copies())
        logits = self.runner.execute(batch).logits  # [len(logits_seq_ids), V]
        if not batch.logits_seq_ids:
            return {}
        return dict(zip(batch.logits_seq_ids, torch.argmax(logits, dim=-1).tolist()))
