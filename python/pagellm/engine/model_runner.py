"""SchedulerOutput -> tensors -> model forward -> logits of the rows that sample.

Per step: apply the scheduler's copy-on-write block copies, build `AttentionMetadata`, `plan()` the
attention backend once, run the model with a `ForwardContext`, then compute logits only for the
sampling rows (`logits_indices`), plus every position of the prompt chunks whose request asked
for prompt logprobs.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from pagellm.attention.base import AttentionMetadata, BaseAttentionBackend
from pagellm.attention.cpu_backend import MULTI_QUERY_MAX_LEN
from pagellm.attention.kv_groups import KVGroupAttention
from pagellm.attention.tree_verify import TreeVerifyAttention
from pagellm.engine.cuda_graphs import CudaGraphCaptureError, CudaGraphRunner
from pagellm.engine.tree_step import pad_tree_step, tree_step_inputs
from pagellm.distributed import get_pp_state
from pagellm.kv_cache import KVCaches
from pagellm.logger import init_logger
from pagellm.ops.row_dispatch import gather_rows
from pagellm.forward_context import ForwardContext
from pagellm.step_graph import StepGraphCache, iter_tensors

logger = init_logger(__name__)

try:
    from pagellm import _C as _compiled  # noqa: F401

    _C_AVAILABLE = True
except ImportError:  # pragma: no cover - a build without the extension runs every step eagerly
    _C_AVAILABLE = False


@dataclass
class ModelRunnerOutput:
    logits: torch.Tensor  # model dtype [len(logits_indices), V], logits_indices order (1 + k rows per spec row)
    # row index (in the scheduler output) -> [num_scheduled_tokens, V] logits of the chunk (model dtype)
    prompt_logits: dict[int, torch.Tensor]
    # [sum of num_scheduled_tokens over hidden_state_rows, hidden]: the final (normed) hidden states of
    # every position of each requested row, in the requested row order (None when none were requested)
    hidden_states: torch.Tensor | None = None
    # the step ran eagerly or was captured on its way to a step graph (its shape's first sightings): a one-time
    # cost, not a sample of what such a step costs (the speculative switch leaves it out, spec_decode/switch.py)
    graph_warmup: bool = False
    # int64 [len(logits_indices)]: each sampling row's argmax token, when the step asked for greedy token ids and
    # the LM head fused the argmax (then `logits` is empty: [0, 0]); None otherwise
    sampled_token_ids: torch.Tensor | None = None


# the longest row a tree verification step may have to replay from a step graph (a spec row: 1 + its tree's nodes)
MAX_TREE_GRAPH_QUERY_LEN = 64
STEP_GRAPH_ENV = "PAGELLM_STEP_GRAPH"  # "0" runs every step eagerly (A/B tests, debugging)
# "1": every replay is checked against the eager forward (bit-identical or StepGraphMismatch); for debugging
STEP_GRAPH_CHECK_ENV = "PAGELLM_STEP_GRAPH_CHECK"


def _block_table_width(width: int) -> int:
    """Decode steps pad their block tables to a power of two (>= 8) columns, so that one captured graph
    serves a batch size while its sequences grow (the kernels read only the blocks seq_lens cover)."""
    return max(8, 1 << max(0, width - 1).bit_length())


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attn_backend: BaseAttentionBackend,
                 kv_caches: KVCaches, device: torch.device, use_step_graph: bool | None = None,
                 max_batch: int | None = None, max_blocks_per_seq: int | None = None) -> None:
        """`max_batch` / `max_blocks_per_seq`: the largest decode step (rows, block-table columns) CUDA graphs
        are sized for (engine/cuda_graphs.py); without them, a CUDA runner runs every step eagerly."""
        self.model = model
        # a hybrid KV cache: each layer attends through its group's block table (attention/kv_groups.py)
        self.attn_backend = KVGroupAttention(attn_backend, kv_caches.layer_groups) if kv_caches.num_groups > 1 \
            else attn_backend
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.lora_state = None  # a LoRAStepState when LoRA is on (set by the Worker)
        self._padded_tables: dict[tuple[int, int, int], torch.Tensor] = {}  # decode graphs' block-table inputs
        if use_step_graph is None:
            use_step_graph = os.environ.get(STEP_GRAPH_ENV, "1") != "0"
        # Steps of short rows on CPU (decodes, verify rows) are captured once per (tokens, block-table width) and
        # replayed from C++: the per-op Python cost is a third of a batch-1 step on a small model (see step_graph/).
        self.step_graphs: StepGraphCache | None = None
        if use_step_graph and self.device.type == "cpu" and attn_backend.step_graph_safe and _C_AVAILABLE:
            self.step_graphs = StepGraphCache(iter_tensors([model, kv_caches]),
                                              check=os.environ.get(STEP_GRAPH_CHECK_ENV, "0") == "1")
        # On CUDA the launches are the cost: pure decode steps replay CUDA graphs (one per batch-size bucket).
        self.cuda_graphs: CudaGraphRunner | None = None
        if (use_step_graph and self.device.type == "cuda" and max_batch and max_blocks_per_seq
                and kv_caches.num_groups == 1):
            self.cuda_graphs = CudaGraphRunner(self._forward, max_batch, max_blocks_per_seq, self.device)

    def invalidate_step_graphs(self) -> None:
        """Forget captured graphs: call after replacing weight or KV-cache tensors (not after in-place copies)."""
        if self.step_graphs is not None:
            self.step_graphs.invalidate(iter_tensors([self.model, self.kv_caches]))
        if self.cuda_graphs is not None:
            self.cuda_graphs.invalidate()

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        """A scheduler-output array (already the right dtype, C-contiguous) as a tensor on the model's device."""
        t = torch.from_numpy(arr)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def build_metadata(self, sched_out) -> AttentionMetadata:
        num_reqs, num_decode_reqs = sched_out.num_reqs, sched_out.num_decode_reqs
        groups = range(1, self.kv_caches.num_groups)  # a hybrid cache's groups past 0: their own ids
        seq_lens = sched_out.seq_lens  # each property read makes a new numpy view: read once
        # pure decodes (one token each) come first, so a decode-only step's longest row is 1 without a reduction
        max_query_len = 1 if num_decode_reqs == num_reqs else int(sched_out.num_scheduled_tokens.max())
        return AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=sched_out.total_num_scheduled_tokens,
            num_decode_reqs=num_decode_reqs,
            max_query_len=max_query_len if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            slot_mapping=self._to_device(sched_out.slot_mapping),
            block_tables=self._to_device(sched_out.block_tables),
            seq_lens=self._to_device(seq_lens),
            query_start_loc=self._to_device(sched_out.query_start_loc),
            group_slot_mappings=tuple(self._to_device(sched_out.group_slot_mapping(g)) for g in groups),
            group_block_tables=tuple(self._to_device(sched_out.group_block_tables(g)) for g in groups),
        )

    def _forward(self, metadata: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
                 backend: BaseAttentionBackend | None = None) -> torch.Tensor:
        """The model's forward for one step: plan the attention backend, run the module tree."""
        backend = backend or self.attn_backend
        backend.plan(metadata)
        return self.model(input_ids, positions, ForwardContext(attn_backend=backend, kv_caches=self.kv_caches))

    def _lora_scope(self, token_slots: torch.Tensor | None):
        return contextlib.nullcontext() if token_slots is None else self.lora_state.step(token_slots)

    def _decode_with_graph(self, md: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A decode-only step (one token per row) through the step graph of its shape (captured from `_forward`)."""
        width = md.block_tables.shape[1]
        padded = _block_table_width(width)
        inputs = [input_ids, positions, md.slot_mapping, self._pad_tables(md.block_tables, padded, 0), md.seq_lens,
                  md.query_start_loc]
        extra = len(md.group_slot_mappings)  # a hybrid cache's groups 1..: their slot mappings, then their tables
        inputs += [*md.group_slot_mappings,
                   *(self._pad_tables(t, padded, g + 1) for g, t in enumerate(md.group_block_tables))]

        def step(ins: list[torch.Tensor]) -> torch.Tensor:
            step_md = replace(md, slot_mapping=ins[2], block_tables=ins[3], seq_lens=ins[4], query_start_loc=ins[5],
                              group_slot_mappings=tuple(ins[6 : 6 + extra]), group_block_tables=tuple(ins[6 + extra :]))
            return self._forward(step_md, ins[0], ins[1])

        return self.step_graphs.run((md.num_reqs, padded), inputs, step)

    def _pad_tables(self, tables: torch.Tensor, padded: int, group: int) -> torch.Tensor:
        """Block tables [rows, width] zero-padded to `padded` columns, written into a buffer kept per (rows, padded,
        group) rather than allocated per step (the step graph reads its inputs during the call, so reuse is safe)."""
        rows, width = tables.shape
        if padded == width:
            return tables
        key = (rows, padded, group)
        buf = self._padded_tables.get(key)
        if buf is None or buf.dtype != tables.dtype or buf.device != tables.device:
            buf = self._padded_tables[key] = torch.zeros((rows, padded), dtype=tables.dtype, device=tables.device)
        if tables.device.type == "cpu":  # numpy's slice assignment: ~1 us, against ~5 us for two torch ops
            out = buf.numpy()
            out[:, :width] = tables.numpy()
            out[:, width:] = 0
        else:
            buf[:, :width].copy_(tables)
            buf[:, width:].zero_()
        return buf

    def _tree_with_graph(self, md: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
                         tree_mask: torch.Tensor, tree_pad_tokens: int = 0) -> torch.Tensor:
        """A tree verification step of short rows through the step graph of its shape: keyed by rows, tokens,
        block-table width and mask width (the tree's shape is data: the mask and positions are inputs).
        `tree_pad_tokens`: dummy tokens that give a step of clamped trees its full trees' shape (pad_tree_step)."""
        width = md.block_tables.shape[1]
        padded = _block_table_width(width)
        num_tokens = md.num_tokens
        if 0 < tree_pad_tokens and md.max_query_len + tree_pad_tokens <= MAX_TREE_GRAPH_QUERY_LEN:
            block_size = self.kv_caches[self.kv_caches.layer_ids[0]].key_cache.shape[2]
            grown = pad_tree_step(md, input_ids, positions, tree_mask, tree_pad_tokens, padded * block_size)
            if grown is not None:
                md, input_ids, positions, tree_mask = grown
        tables = md.block_tables
        if padded != width:
            tables = torch.zeros((md.num_reqs, padded), dtype=tables.dtype, device=tables.device)
            tables[:, :width] = md.block_tables
        inputs = [input_ids, positions, md.slot_mapping, tables, md.seq_lens, md.query_start_loc, tree_mask]

        def step(ins: list[torch.Tensor]) -> torch.Tensor:
            step_md = replace(md, slot_mapping=ins[2], block_tables=ins[3], seq_lens=ins[4], query_start_loc=ins[5])
            return self._forward(step_md, ins[0], ins[1], TreeVerifyAttention(self.attn_backend, ins[6]))

        key = ("tree", md.num_reqs, md.num_tokens, padded, tree_mask.shape[1])
        return self.step_graphs.run(key, inputs, step)[:num_tokens]

    def _lora_token_slots(self, sched_out, lora_slots: np.ndarray | None) -> torch.Tensor | None:
        """Each scheduled token's adapter slot (int32 [num_tokens]), from the rows' slots."""
        if lora_slots is None:
            return None
        if self.lora_state is None:
            raise ValueError("lora_slots given but LoRA is not enabled on this worker")
        return self._to_device(np.repeat(np.asarray(lora_slots, dtype=np.int32), sched_out.num_scheduled_tokens))

    @torch.inference_mode()
    def execute(self, sched_out, prompt_logprob_rows: list[int] | None = None,
                hidden_state_rows: list[int] | None = None, lora_slots: np.ndarray | None = None,
                draft_parents: np.ndarray | None = None, tree_pad_tokens: int = 0,
                greedy_token_ids: bool = False) -> ModelRunnerOutput:
        """`lora_slots`: int32 adapter slot per row (-1: none), or None when no row uses an adapter.
        `draft_parents`: the spec rows' drafts are trees (engine/tree_step.py): each draft's parent in its row;
        `tree_pad_tokens`: the nodes the scheduler clamped off those trees (a replayed step is padded back).
        `greedy_token_ids`: every sampling row wants only its argmax token (plain greedy, no prompt logprobs):
        where the model's LM head fuses the argmax, the output carries `sampled_token_ids` and no logits."""
        cow_copies = sched_out.cow_copies
        if len(cow_copies) and self.kv_caches.num_groups == 1:
            self.kv_caches.copy_blocks(self._to_device(cow_copies))
        elif len(cow_copies):  # a hybrid cache: each pair copies in its own group's layers
            groups = sched_out.cow_copy_groups
            for g in np.unique(groups):
                self.kv_caches.copy_blocks(self._to_device(np.ascontiguousarray(cow_copies[groups == g])), int(g))

        metadata = self.build_metadata(sched_out)
        cuda_graph_captured = False
        warmups = self.step_graphs.num_warmup_runs if self.step_graphs is not None else 0
        input_ids, positions = self._to_device(sched_out.input_ids), self._to_device(sched_out.positions)
        token_slots = self._lora_token_slots(sched_out, lora_slots)
        if draft_parents is not None:  # tree verification: tree positions, one tree-masked attention call per layer
            tree_positions, tree_mask = tree_step_inputs(sched_out, draft_parents)
            positions, tree_mask = self._to_device(tree_positions), tree_mask.to(self.device)
            if token_slots is None and self.step_graphs is not None and _replays_as_tree(metadata, self.kv_caches):
                hidden = self._tree_with_graph(metadata, input_ids, positions, tree_mask, tree_pad_tokens)
            else:
                with self._lora_scope(token_slots):
                    hidden = self._forward(metadata, input_ids, positions,
                                           TreeVerifyAttention(self.attn_backend, tree_mask))
        elif token_slots is None and self.step_graphs is not None and _replays_as_decode(metadata):
            hidden = self._decode_with_graph(_rows_as_decode_tokens(metadata), input_ids, positions)
        elif token_slots is None and self.cuda_graphs is not None and self.cuda_graphs.can_run(metadata):
            try:
                hidden, cuda_graph_captured = self.cuda_graphs.run(metadata, input_ids, positions)
            except CudaGraphCaptureError as e:  # nothing ran: this step and the later ones go eager
                logger.warning("CUDA graphs off: %s", e)
                self.cuda_graphs = None
                hidden = self._forward(metadata, input_ids, positions)
        elif token_slots is not None:  # LoRA steps run eagerly: their hooks read the slots (pagellm.lora.layers)
            with self.lora_state.step(token_slots):
                hidden = self._forward(metadata, input_ids, positions)
        else:
            hidden = self._forward(metadata, input_ids, positions)

        graph_warmup = cuda_graph_captured or (self.step_graphs is not None
                                               and self.step_graphs.num_warmup_runs != warmups)
        if not get_pp_state().is_last_stage:  # its activations went to the next stage; the last one's output counts
            return ModelRunnerOutput(logits=hidden.new_zeros((0, 0)), prompt_logits={}, graph_warmup=graph_warmup)
        logits_indices = sched_out.logits_indices
        hidden_states = None
        if hidden_state_rows:  # draft heads read these (speculative decoding)
            rows, qsl = [int(r) for r in hidden_state_rows], sched_out.query_start_loc
            # a copy (the proposer keeps rows past this step; a replay reuses `hidden`'s buffer): of a slice when the
            # rows are consecutive (batch 1) and few (a copy below torch's parallel grain stays on this thread), else
            # by gather_rows: hidden[tensor] is an OpenMP region from ~6 rows on, which cost batch-8 Medusa steps ~5 ms
            # each
            start, end = int(qsl[rows[0]]), int(qsl[rows[-1] + 1])
            if rows == list(range(rows[0], rows[0] + len(rows))) and (end - start) * hidden.shape[-1] < 32768:
                hidden_states = hidden[start:end].clone()
            else:
                positions_of_rows = np.concatenate([np.arange(qsl[r], qsl[r + 1], dtype=np.int64) for r in rows])
                hidden_states = gather_rows(hidden, self._to_device(positions_of_rows))
        gather, spans = _gather_positions(logits_indices, sched_out.query_start_loc, prompt_logprob_rows or [])
        if len(gather) == 0:
            return ModelRunnerOutput(logits=hidden.new_zeros((0, 0)), prompt_logits={}, hidden_states=hidden_states,
                                     graph_warmup=graph_warmup)
        rows = _take_positions(hidden, gather, self._to_device)
        if greedy_token_ids and not spans and len(gather) == len(logits_indices):
            greedy = getattr(self.model, "compute_greedy_token_ids", None)
            token_ids = greedy(rows) if greedy is not None else None
            if token_ids is not None:  # the head's argmax without its [N, V] logits (linear_argmax)
                return ModelRunnerOutput(logits=hidden.new_zeros((0, 0)), prompt_logits={}, hidden_states=hidden_states,
                                         graph_warmup=graph_warmup, sampled_token_ids=token_ids)
        logits = self.model.compute_logits(rows)  # model dtype
        prompt_logits = {r: logits[p : p + n] for r, p, n in spans}
        return ModelRunnerOutput(logits=logits[: len(logits_indices)], prompt_logits=prompt_logits,
                                 hidden_states=hidden_states, graph_warmup=graph_warmup)


def _replays_as_decode(md: AttentionMetadata) -> bool:
    """Steps whose rows all have at most MULTI_QUERY_MAX_LEN tokens (decodes, speculative verify rows of 1 + k,
    short prompts) replay through the decode graphs: the cpu backend, the only one step graphs run with,
    attends such rows one decode-kernel query per token anyway (attention/cpu_backend.py)."""
    return md.num_tokens > 0 and md.num_reqs > 0 and md.max_query_len <= MULTI_QUERY_MAX_LEN


def _replays_as_tree(md: AttentionMetadata, kv_caches: KVCaches) -> bool:
    """Tree verification steps of short rows (decodes, spec rows with trees, short prompts) on a one-group KV cache
    replay through tree graphs; longer prefill chunks would multiply the keys (one per chunk length) for little."""
    return md.num_reqs > 0 and md.max_query_len <= MAX_TREE_GRAPH_QUERY_LEN and kv_caches.num_groups == 1


def _rows_as_decode_tokens(md: AttentionMetadata) -> AttentionMetadata:
    """A step of short rows as one decode per token: its row's block table, its own context length (position
    + 1). The same kernel calls with the same arguments as the backend's multi-query plan, so the same bits;
    graphs are then keyed by the number of tokens, whatever mix of rows makes them up."""
    if md.num_decode_reqs == md.num_reqs == md.num_tokens:
        return md
    n, qsl = md.num_tokens, md.query_start_loc[: md.num_reqs + 1].to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    rows = torch.repeat_interleave(torch.arange(md.num_reqs, device=q_lens.device), q_lens, output_size=n)
    offset = torch.arange(n, device=q_lens.device) - qsl[rows]  # the token's index inside its row
    seq_lens = (md.seq_lens[: md.num_reqs].to(torch.int64)[rows] - q_lens[rows] + offset + 1).to(torch.int32)
    return AttentionMetadata(num_reqs=n, num_tokens=n, num_decode_reqs=n, max_query_len=1, max_seq_len=md.max_seq_len,
                             slot_mapping=md.slot_mapping, block_tables=md.block_tables.index_select(0, rows),
                             seq_lens=seq_lens, query_start_loc=torch.arange(n + 1, dtype=torch.int32,
                                                                             device=q_lens.device),
                             group_slot_mappings=md.group_slot_mappings,
                             group_block_tables=tuple(t.index_select(0, rows) for t in md.group_block_tables))


def _take_positions(hidden: torch.Tensor, positions: np.ndarray, to_device) -> torch.Tensor:
    """hidden[positions]: a view when they are consecutive (a decode-only step's every row, a batch-1 verify row),
    else `gather_rows` (ops/row_dispatch.py). Not hidden[tensor]: on CPU that advanced-indexing kernel is an OpenMP
    region from about 6 rows on, which a loaded 2-core machine stalled for 20-45 ms per verify step (torch.profiler,
    load 16); gather_rows runs on pagellm's own pool."""
    n = len(positions)
    if n and int(positions[-1]) - int(positions[0]) == n - 1 and (n == 1 or bool((np.diff(positions) == 1).all())):
        return hidden[int(positions[0]) : int(positions[0]) + n]
    return gather_rows(hidden, to_device(np.ascontiguousarray(positions, dtype=np.int64)))


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
