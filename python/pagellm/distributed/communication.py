"""The collectives the tensor-parallel layers call (over the group in parallel_state; gloo on CPU, and the
group's shared-memory segment (shm_comm) for the all-reduce and all-gather when its ranks share this host).

With a single rank every function returns its input unchanged, so layers call them unconditionally.
Every call is timed into `COLLECTIVE_TIMES` (seconds per kind) so a benchmark can report the
all-reduce share of a step.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from pagellm.distributed.parallel_state import get_tp_state

# kind ("all_reduce", "all_gather") -> [seconds, calls] in this process; a registry of counters, reset by the reader
COLLECTIVE_TIMES: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])


def _record(kind: str, t0: float) -> None:
    entry = COLLECTIVE_TIMES[kind]
    entry[0] += time.perf_counter() - t0
    entry[1] += 1


def take_collective_times() -> dict[str, tuple[float, int]]:
    """{kind: (seconds, calls)} since the last call, then reset."""
    out = {k: (v[0], int(v[1])) for k, v in COLLECTIVE_TIMES.items()}
    COLLECTIVE_TIMES.clear()
    return out


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks (any shape; every rank gets the sum). In place on a contiguous `x`.
    Through the group's shared memory when it has one (CPU float32 / bfloat16 / float16; sums in rank
    order, fp32 accumulation), else gloo."""
    state = get_tp_state()
    if state.size == 1:
        return x
    t0 = time.perf_counter()
    if state.shm is not None and state.shm.supports(x):
        x = state.shm.all_reduce(x)
        _record("all_reduce", t0)
        return x
    import torch.distributed as dist  # noqa: PLC0415

    x = x.contiguous()
    dist.all_reduce(x, group=state.group)
    _record("all_reduce", t0)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' `x` (same shape on each) concatenated along `dim` in rank order. Through the group's
    shared memory when its all-reduce uses it (CPU tensors), else gloo."""
    state = get_tp_state()
    if state.size == 1:
        return x
    t0 = time.perf_counter()
    if state.shm is not None and x.device.type == "cpu":
        out = state.shm.all_gather(x, dim)
        _record("all_gather", t0)
        return out
    import torch.distributed as dist  # noqa: PLC0415

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.size)]
    dist.all_gather(parts, x, group=state.group)
    _record("all_gather", t0)
    return torch.cat(parts, dim=dim)
