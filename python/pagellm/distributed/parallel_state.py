"""This process's place in the tensor-parallel group and its pipeline stage.

One value per process, set once by the worker process before it builds its model
(`pagellm.engine.mp_executor`), read by the layers while they are constructed and run. The default is a
single rank with no process group, so in-process (TP=1) code paths never change. It is the one piece of
process state here on purpose: a rank is a property of the process (as the torch.distributed default
group is), and threading it through every model constructor would touch every model file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TensorParallelState:
    """rank in [0, size); `group`: the torch.distributed process group of the ranks (None when size == 1);
    `shm`: the group's same-host shared-memory all-reduce (distributed.shm_comm.ShmCommunicator), or None
    for gloo only (ranks on several nodes, PAGELLM_TP_ALLREDUCE=gloo)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    shm: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensor parallel size must be an integer >= 1, got {self.size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank must be an integer in [0, {self.size}), got {self.rank!r}")


_SINGLE_RANK = TensorParallelState()
_state: list[TensorParallelState] = [_SINGLE_RANK]  # one slot: this process's state


def get_tp_state() -> TensorParallelState:
    return _state[0]


def set_tp_state(state: TensorParallelState | None) -> TensorParallelState:
    """Set this process's tensor-parallel state (None: back to a single rank); returns the previous one."""
    if state is not None and not isinstance(state, TensorParallelState):
        raise TypeError(f"state must be a TensorParallelState or None, got {type(state).__name__}")
    previous = _state[0]
    _state[0] = _SINGLE_RANK if state is None else state
    return previous


def get_tp_size() -> int:
    return _state[0].size


def get_tp_rank() -> int:
    return _state[0].rank


@dataclass
class StageTraffic:
    """Activation sends / receives this stage made (pagellm.distributed.pipeline counts them): a step that fails
    half-way is completed from them, so the stages stay at the same step."""

    num_sent: int = 0
    num_received: int = 0


@dataclass(frozen=True)
class PipelineParallelState:
    """This process's pipeline stage: `rank` in [0, size) and the decoder layers [layer_start, layer_end) it
    holds (pagellm.distributed.pipeline.stage_layer_range); `prev_rank` / `next_rank`: the global ranks
    (torch.distributed default group) it receives activations from / sends them to (None at the ends).
    A single stage (the default) holds every layer: layer_end None = up to the model's last layer."""

    rank: int = 0
    size: int = 1
    layer_start: int = 0
    layer_end: int | None = None
    prev_rank: int | None = None
    next_rank: int | None = None
    traffic: StageTraffic = field(default_factory=StageTraffic, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"pipeline parallel size must be an integer >= 1, got {self.size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"pipeline parallel rank must be an integer in [0, {self.size}), got {self.rank!r}")

    @property
    def is_first_stage(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.rank == self.size - 1

    def owns_layer(self, layer_idx: int) -> bool:
        return self.layer_start <= layer_idx and (self.layer_end is None or layer_idx < self.layer_end)


_SINGLE_STAGE = PipelineParallelState()
_pp_state: list[PipelineParallelState] = [_SINGLE_STAGE]  # one slot: this process's stage


def get_pp_state() -> PipelineParallelState:
    return _pp_state[0]


def set_pp_state(state: PipelineParallelState | None) -> PipelineParallelState:
    """Set this process's pipeline stage (None: back to a single stage); returns the previous one."""
    if state is not None and not isinstance(state, PipelineParallelState):
        raise TypeError(f"state must be a PipelineParallelState or None, got {type(state).__name__}")
    previous = _pp_state[0]
    _pp_state[0] = _SINGLE_STAGE if state is None else state
    return previous


def get_pp_size() -> int:
    return _pp_state[0].size
