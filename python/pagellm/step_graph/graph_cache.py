"""Captured step graphs, one per shape key, replayed from C++ (`pagellm._C.StepGraph`).

The model runner asks `StepGraphCache.run(key, inputs, forward)` each decode step. A key seen for the
`capture_after`-th time is captured: `forward(inputs)` runs eagerly under a `StepRecorder`, and its
calls become a `StepGraph`. Later steps with that key replay the graph without Python in between.
A step that cannot be captured runs eagerly, and its key is never tried again (logged once).
At most `max_graphs` graphs are kept (least recently used dropped).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Iterable

import torch

from pagellm.logger import init_logger
from pagellm.step_graph.recorder import CaptureError, Recording, StepRecorder

logger = init_logger(__name__)

class StepGraphMismatch(RuntimeError):
    """A replayed step differed from the eager forward (only raised with check=True)."""


StepFn = Callable[[list[torch.Tensor]], torch.Tensor]


def build_step_graph(recording: Recording, output_slots: list[int]):
    """A finalized `pagellm._C.StepGraph` from a recording; CaptureError if an argument will not convert."""
    from pagellm import _C  # noqa: PLC0415

    graph = _C.StepGraph(recording.num_inputs)
    try:
        for call in recording.calls:
            graph.add_node(call.name, call.overload, call.args, call.outputs)
        graph.finalize(output_slots)
    except (RuntimeError, ValueError, TypeError) as e:
        raise CaptureError(f"cannot build the step graph: {e}") from e
    return graph


class StepGraphCache:
    """Graphs of one step function by shape key. `constants`: every tensor the step may read that is not
    an input (weights, buffers, KV caches); call `invalidate(constants)` when those tensors are replaced."""

    def __init__(self, constants: Iterable[torch.Tensor], max_graphs: int = 64, capture_after: int = 2,
                 check: bool = False) -> None:
        if max_graphs < 1 or capture_after < 1:
            raise ValueError(f"max_graphs and capture_after must be >= 1, got {max_graphs}, {capture_after}")
        self.max_graphs = max_graphs
        self.capture_after = capture_after
        # check: every replay also runs the step eagerly and raises StepGraphMismatch unless the results are
        # bit-identical (for a forward you wrote: a data read into Python that the recorder could not see,
        # such as .tolist() on step data, shows up here). The step's KV writes are idempotent, so this is safe.
        self.check = check
        self._graphs: OrderedDict[Hashable, object] = OrderedDict()
        self._failed: dict[Hashable, str] = {}
        self._seen: dict[Hashable, int] = {}
        self.num_captures = 0
        # steps of a key not captured yet run eagerly, the capture included: one-time costs, which a timer of
        # steady steps (the speculative switch, spec_decode/switch.py) must leave out
        self.num_warmup_runs = 0
        self.num_replays = 0
        self.num_replays_by_key: dict[Hashable, int] = {}  # which shapes replay (tests, profiling)
        self.invalidate(constants)

    def invalidate(self, constants: Iterable[torch.Tensor]) -> None:
        """Drop every graph and re-declare the constant tensors."""
        self._constants = list(constants)
        self._constant_ids = {id(t) for t in self._constants}
        self._graphs.clear()
        self._failed.clear()
        self._seen.clear()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, inputs: list[torch.Tensor], step: StepFn) -> torch.Tensor:
        """step(inputs), replayed from a graph when one exists for `key`."""
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            self.num_replays += 1
            self.num_replays_by_key[key] = self.num_replays_by_key.get(key, 0) + 1
            out = graph.run(inputs)[0]
            if self.check:
                self._check(key, out, step(inputs))
            return out
        if key in self._failed:
            return step(inputs)
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        self.num_warmup_runs += 1
        if seen < self.capture_after:
            return step(inputs)
        return self._capture(key, inputs, step)

    @staticmethod
    def _check(key: Hashable, replayed: torch.Tensor, eager: torch.Tensor) -> None:
        if not torch.equal(replayed, eager):
            diff = (replayed.float() - eager.float()).abs().max().item()
            raise StepGraphMismatch(f"step graph {key} replayed a result that differs from the eager forward (max "
                                    f"|diff| {diff:.3g}): the forward makes a data-dependent choice the recorder "
                                    "cannot see; set step_graph_safe = False on its backend or run with enforce_eager")

    def _capture(self, key: Hashable, inputs: list[torch.Tensor], step: StepFn) -> torch.Tensor:
        recorder = StepRecorder(inputs, lambda t: id(t) in self._constant_ids)
        try:
            with recorder:
                out = step(inputs)
            graph = build_step_graph(recorder.recording, [recorder.slot(out)])
        except CaptureError as e:
            self._failed[key] = str(e)
            logger.warning("step graph for %s not captured, running eagerly: %s", key, e)
            # The interrupted step only rewrote this step's KV slots with the same values: run it again.
            return step(inputs)
        self._seen.pop(key, None)
        self._graphs[key] = graph
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        self.num_captures += 1
        return out
