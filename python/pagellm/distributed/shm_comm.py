"""A shared-memory all-reduce for the tensor-parallel ranks of one host (the C++ `ShmAllReduce`,
csrc/ops/comm/shm_allreduce.h).

Why: gloo's all-reduce goes through loopback TCP and costs ~0.6 ms per call whatever the size, which
dominates a decode step's dozens of [1, hidden] all-reduces. Ranks on one host meet in one POSIX shm
segment instead: each copies its chunk into its slot, waits for the others' (short spin, then a futex
sleep), and sums the slots in rank order, so every rank gets the same bits.

Life cycle: the driver (engine/mp_executor.py) picks a unique base name per executor
(`new_segment_name`) and hands it to every rank; each pipeline stage's TP group uses its own segment
(`stage_segment_name`). Rank 0 of the group creates it, the others attach; the name is unlinked as soon as
every rank attached, so a worker that dies later leaks nothing. The driver unlinks the names again at
shutdown (`unlink_segments`) for a rank that died during set-up. Ranks on other nodes (the Ray executor)
keep gloo. The vocab-parallel LM head's all-gather goes through the same segment (and the same round
counter) whenever the all-reduce does.
"""

from __future__ import annotations

import os
import uuid

import torch

ALLREDUCE_BACKEND_ENV = "PAGELLM_TP_ALLREDUCE"  # "shm" | "gloo"; unset: shm for same-host ranks
SHM_TIMEOUT_ENV = "PAGELLM_TP_SHM_TIMEOUT_S"  # the longest one wait for a peer (default 60 s)
ALLREDUCE_BACKENDS = ("shm", "gloo")
DEFAULT_SLOT_BYTES = 1 << 20  # per-rank chunk: a decode all-reduce is one round, larger tensors several
DEFAULT_TIMEOUT_S = 60.0
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def allreduce_backend() -> str:
    """The all-reduce for same-host TP ranks: PAGELLM_TP_ALLREDUCE ("shm" or "gloo"), default "shm".
    ValueError for any other value."""
    value = os.environ.get(ALLREDUCE_BACKEND_ENV, "").strip().lower() or "shm"
    if value not in ALLREDUCE_BACKENDS:
        raise ValueError(f"{ALLREDUCE_BACKEND_ENV} must be one of {ALLREDUCE_BACKENDS}, got {value!r}")
    return value


def shm_timeout_s() -> float:
    """PAGELLM_TP_SHM_TIMEOUT_S (> 0), default 60; ValueError otherwise."""
    raw = os.environ.get(SHM_TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{SHM_TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{SHM_TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


def new_segment_name() -> str:
    """A fresh base name for one executor's segments (unique per process and call)."""
    return f"/pagellm-tp-{os.getpid()}-{uuid.uuid4().hex[:16]}"


def stage_segment_name(base: str, pp_rank: int) -> str:
    """The segment of pipeline stage `pp_rank`'s tensor-parallel group."""
    return f"{base}-pp{pp_rank}"


def unlink_segments(base: str, pp_size: int) -> None:
    """Removes every stage's segment name (a no-op for names already gone)."""
    from pagellm import _C  # noqa: PLC0415

    for pp_rank in range(pp_size):
        _C.shm_unlink(stage_segment_name(base, pp_rank))


class ShmCommunicator:
    """This rank's handle on its TP group's segment. Create it on every rank of the group with the same
    name and world size (rank 0 first or concurrently: the others wait up to `timeout_s` for it)."""

    def __init__(self, name: str, rank: int, world_size: int, timeout_s: float | None = None,
                 slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        from pagellm import _C  # noqa: PLC0415

        self.timeout_s = shm_timeout_s() if timeout_s is None else float(timeout_s)
        try:
            self._comm = _C.ShmAllReduce(name, rank, world_size, slot_bytes=slot_bytes, timeout_s=self.timeout_s)
        except RuntimeError as e:  # e.g. /dev/shm missing or full: say how to do without it
            raise RuntimeError(f"{e} ({ALLREDUCE_BACKEND_ENV}=gloo uses gloo instead)") from e

    @property
    def name(self) -> str:
        return self._comm.name

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """True for CPU float32 / bfloat16 / float16 tensors (anything else goes through gloo)."""
        return x.device.type == "cpu" and x.dtype in SUPPORTED_DTYPES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` (any shape) over the ranks; in place on a contiguous `x`, else on a contiguous copy
        (use the returned tensor). RuntimeError naming the rank when a peer died or timed out."""
        x = x.contiguous()
        self._comm.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` (same shape and dtype on each, CPU) concatenated along `dim` in rank order (one
        copy into the segment, one out per rank, then the concatenation). Same failure rules as all_reduce."""
        stacked = self._comm.all_gather(x)  # [world, *x.shape]
        if stacked.shape[0] == 1:
            return stacked[0]
        dim = dim % x.dim()
        return torch.cat(stacked.unbind(0), dim=dim) if dim else stacked.flatten(0, 1)
