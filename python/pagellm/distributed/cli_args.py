"""--tensor-parallel-size / --distributed-executor-backend for `pagellm generate` and `serve` (vLLM's names)."""

from __future__ import annotations

import argparse


def _tp_size(s: str) -> int:
    try:
        value = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"tensor parallel size must be an integer >= 1, got {value}")
    return value


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=_tp_size, default=None,
                   help="ranks the model is split over (worker processes on this host, gloo on CPU; default 1)")
    p.add_argument("--distributed-executor-backend", choices=("uni", "mp"), default=None,
                   help="uni: the model in this process; mp: one worker process per rank (default: uni for one "
                        "rank, mp for more)")


def parallel_engine_kwargs(a: argparse.Namespace) -> dict:
    """The engine keyword arguments of the options given (none when left at their defaults)."""
    out = {}
    if getattr(a, "tensor_parallel_size", None) is not None:
        out["tensor_parallel_size"] = a.tensor_parallel_size
    if getattr(a, "distributed_executor_backend", None) is not None:
        out["distributed_executor_backend"] = a.distributed_executor_backend
    return out
