"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed with padded inputs.

A decode step of a small model on a GPU is bound by kernel launches, not by memory: the ~1B model's eager step
ran at MBU 0.13 on an H200 (benchmarks/results/gpu-h200-session14-run1). A CUDA graph launches the whole forward
at once. As in vLLM, graphs are keyed by a bucket of the batch size (1, 2, 4, 8, then multiples of 8 up to the
largest batch the scheduler may send), captured the first time a bucket is needed, from the one forward
(`ModelRunner._forward`), over static input buffers sized for the largest bucket:

- a step's rows go to the first `n` rows of the buffers; the bucket's other rows are padding: slot -1 (the
  cache write skips it), seq_len 0 (the decode kernel writes zeros), token 0 at position 0;
- the block-table buffer has the widest table a request can have (max_model_len / block_size columns); a step
  copies its own columns and the kernels read only the blocks a row's seq_len covers, so stale columns past
  them are never read;
- the graphs share one memory pool; each holds its output buffer, which the next replay of the same graph
  overwrites (the caller copies what it keeps: logits are computed at once, draft hidden states gathered).

Only pure decode steps (one token per row) on a one-group KV cache without LoRA replay; everything else runs
eagerly. `enforce_eager=True` turns graphs off. Graphs hold raw pointers to the weights and the KV cache:
`invalidate()` after replacing those tensors (in-place copies, as weight updates do, keep the graphs valid).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagellm.attention.base import AttentionMetadata

# The largest bucket captured by default (vLLM captures up to 512; a larger decode batch runs eagerly).
MAX_CAPTURE_BATCH = 256


def capture_sizes(max_batch: int) -> list[int]:
    """Batch-size buckets for at most `max_batch` rows: 1, 2, 4, 8, 16, 24, ... (multiples of 8), ending at the
    first bucket >= min(max_batch, MAX_CAPTURE_BATCH)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    top = min(max_batch, MAX_CAPTURE_BATCH)
    sizes = []
    for s in [1, 2, 4, *range(8, MAX_CAPTURE_BATCH + 1, 8)]:
        sizes.append(s)
        if s >= top:
            break
    return sizes


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding `n` rows, or None when `n` exceeds every bucket."""
    return next((s for s in sizes if s >= n), None)


class CudaGraphCaptureError(RuntimeError):
    """The forward could not be captured (an op that syncs with the host, say): the runner falls back to eager."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # [bucket, hidden]: the captured forward's output buffer


class CudaGraphRunner:
    """Captures and replays decode-step graphs of one model (see the module docstring)."""

    def __init__(self, forward: Callable[[AttentionMetadata, torch.Tensor, torch.Tensor], torch.Tensor],
                 max_batch: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self._forward = forward
        self.sizes = capture_sizes(max_batch)
        self.device = torch.device(device)
        n, w = self.sizes[-1], max(1, max_blocks_per_seq)
        self.max_blocks_per_seq = w
        i64, i32 = dict(dtype=torch.int64, device=self.device), dict(dtype=torch.int32, device=self.device)
        self._ids, self._positions = torch.zeros(n, **i64), torch.zeros(n, **i64)
        self._slots = torch.full((n,), -1, **i64)
        self._tables = torch.zeros((n, w), **i32)
        self._seq_lens = torch.zeros(n, **i32)
        self._qsl = torch.arange(n + 1, **i32)
        self._graphs: dict[int, _Graph] = {}
        self._pool = None
        self.num_captures = 0  # graphs captured since construction (invalidate() included): tests, benchmarks

    def can_run(self, md: AttentionMetadata) -> bool:
        """Pure decode steps that fit a bucket and the block-table buffer."""
        return (md.num_reqs == md.num_decode_reqs == md.num_tokens and 0 < md.num_reqs <= self.sizes[-1]
                and not md.group_slot_mappings and md.block_tables.shape[1] <= self.max_blocks_per_seq)

    def invalidate(self) -> None:
        """Drop every graph (their pointers to replaced weight / KV tensors would be stale)."""
        self._graphs.clear()
        self._pool = None

    @property
    def captured_buckets(self) -> list[int]:
        return sorted(self._graphs)

    def replay(self, bucket: int) -> None:
        """Replays bucket's graph on the inputs of the last step that used it (benchmarks: the GPU time of a step
        without the host loop around it; it rewrites the KV rows that step wrote, with the same values)."""
        self._graphs[bucket].graph.replay()

    def _metadata(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_reqs=b, num_tokens=b, num_decode_reqs=b, max_query_len=1,
            max_seq_len=self.max_blocks_per_seq,  # not read by the kernels (an upper bound in blocks is enough)
            slot_mapping=self._slots[:b], block_tables=self._tables[:b], seq_lens=self._seq_lens[:b],
            query_start_loc=self._qsl[: b + 1])

    def _pad_all(self) -> None:
        self._ids.zero_()
        self._positions.zero_()
        self._slots.fill_(-1)
        self._seq_lens.zero_()

    def _capture(self, b: int) -> _Graph:
        self._pad_all()  # a warm-up on padding rows only: it writes nothing to the KV cache
        md = self._metadata(b)
        self._forward(md, self._ids[:b], self._positions[:b])  # lazy initialisation (cuBLAS handles, workspaces)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self._forward(md, self._ids[:b], self._positions[:b])
        self._pool = graph.pool()
        self.num_captures += 1
        return _Graph(graph, output)

    def run(self, md: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The step's hidden states [n, hidden] (a view of the graph's output buffer) and whether a graph was
        captured for it (a one-time cost: ModelRunnerOutput.graph_warmup)."""
        n, w = md.num_reqs, md.block_tables.shape[1]
        b = bucket_for(n, self.sizes)
        captured = b not in self._graphs
        if captured:
            try:
                self._graphs[b] = self._capture(b)
            except RuntimeError as e:
                raise CudaGraphCaptureError(f"capturing the decode step of batch {b} failed: {e}") from e
        self._ids[:n].copy_(input_ids[:n])
        self._positions[:n].copy_(positions[:n])
        self._slots[:n].copy_(md.slot_mapping[:n])
        self._tables[:n, :w].copy_(md.block_tables[:n])
        self._seq_lens[:n].copy_(md.seq_lens[:n])
        if b > n:  # the bucket's padding rows (a previous, larger step may have left real values there)
            self._slots[n:b].fill_(-1)
            self._seq_lens[n:b].zero_()
        g = self._graphs[b]
        g.graph.replay()
        return g.output[:n], captured
