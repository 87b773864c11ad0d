"""--tensor-parallel-size / --pipeline-parallel-size (--no-pipeline-microbatching) /
--distributed-executor-backend for `pagellm generate` and `serve` (vLLM's names)."""

from __future__ import annotations

import argparse


def _tp_size(s: str) -> int:
    try:
        value = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a parallel size must be an integer >= 1, got {value}")
    return value


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=_tp_size, default=None,
                   help="ranks the model is split over (worker processes on this host, gloo on CPU; default 1)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=_tp_size, default=None,
                   help="pipeline stages the decoder layers are split over (contiguous layer ranges, one group of "
                        "tensor-parallel ranks each; default 1)")
    p.add_argument("--no-pipeline-microbatching", dest="pipeline_microbatching", action="store_false", default=None,
                   help="with --pipeline-parallel-size > 1: run one batch at a time through the stages instead of "
                        "one micro-batch per stage in flight")
    p.add_argument("--distributed-executor-backend", choices=("uni", "mp", "ray"), default=None,
                   help="uni: the model in this process; mp: one worker process per rank; ray: one Ray actor per "
                        "rank, on any node of a Ray cluster (default: uni for one rank, mp for more)")
    p.add_argument("--ray-address", default=None,
                   help="with --distributed-executor-backend ray: the cluster's head (host:port; default "
                        "RAY_ADDRESS, else a local Ray)")
    p.add_argument("--ray-placement-strategy", choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
                   default=None, help="with --distributed-executor-backend ray: how the ranks spread over nodes "
                                      "(default PACK)")


def parallel_engine_kwargs(a: argparse.Namespace) -> dict:
    """The engine keyword arguments of the options given (none when left at their defaults)."""
    out = {}
    if getattr(a, "tensor_parallel_size", None) is not None:
        out["tensor_parallel_size"] = a.tensor_parallel_size
    if getattr(a, "pipeline_parallel_size", None) is not None:
        out["pipeline_parallel_size"] = a.pipeline_parallel_size
    if getattr(a, "pipeline_microbatching", None) is not None:
        out["pipeline_microbatching"] = a.pipeline_microbatching
    if getattr(a, "distributed_executor_backend", None) is not None:
        out["distributed_executor_backend"] = a.distributed_executor_backend
    for name in ("ray_address", "ray_placement_strategy"):
        if getattr(a, name, None) is not None:
            out[name] = getattr(a, name)
    return out
