"""Executors: how the engine reaches its workers.

    engine -> Executor.execute_model(sched_out)   once per step
           -> Executor.collective_rpc(method)     every worker runs `method`, results in rank order

`method` is the name of a `Worker` method or a callable `fn(worker, *args, **kwargs)`: the seam that
weight updates from an RL trainer, sleep/wake, tensor-parallel set-up and kernel-swap experiments use.
"uni" runs the one worker in process; "mp" (mp_executor.py) runs tensor_parallel_size x
pipeline_parallel_size workers in processes on this host; "ray" (ray_executor.py) runs them as Ray actors on
the nodes of a Ray cluster (both build the same rank grid, distributed/rank_groups.py).

Pipeline micro-batches: an executor whose `max_concurrent_batches` is n > 1 lets the engine submit up to n
steps (`submit_model`) before it collects the oldest (`collect_model`), so pipeline stages work on different
steps at once. The default submit runs the step at once (the handle holds its output).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

from pagellm.config import EngineConfig
from pagellm.engine.model_runner import ModelRunnerOutput
from pagellm.engine.worker import Worker

_EXECUTORS: dict[str, type["ExecutorBase"]] = {}


def register_executor(name: str):
    """Class decorator registering an executor under `name` (replacing any earlier one)."""

    def wrap(cls: type[ExecutorBase]) -> type[ExecutorBase]:
        if not (isinstance(cls, type) and issubclass(cls, ExecutorBase)):
            raise TypeError(f"{cls!r} must subclass ExecutorBase")
        _EXECUTORS[name] = cls
        return cls

    return wrap


def list_executors() -> list[str]:
    return sorted(_EXECUTORS)


def get_executor_cls(name: str) -> type["ExecutorBase"]:
    if name not in _EXECUTORS:
        raise ValueError(f"unknown distributed_executor_backend {name!r}; registered: {list_executors()}")
    return _EXECUTORS[name]


def check_rpc_method(method: str | Callable[..., Any]) -> None:
    """What every executor's collective_rpc accepts, checked before any worker runs anything: a public Worker
    method's name (else AttributeError) or a callable taking the worker first (else TypeError)."""
    if isinstance(method, str):
        if method.startswith("_") or not callable(getattr(Worker, method, None)):
            raise AttributeError(f"Worker has no public method {method!r}")
    elif not callable(method):
        raise TypeError(f"method must be a Worker method name or a callable, got {type(method).__name__}")


class ExecutorBase(ABC):
    """Owns the workers. Every worker holds the same KV-cache geometry, so `num_kv_blocks` is one number."""

    def __init__(self, config: EngineConfig, model_files) -> None:
        self.config = config

    @property
    @abstractmethod
    def num_kv_blocks(self) -> int:
        """KV blocks each worker allocated (the scheduler's block budget)."""

    @abstractmethod
    def execute_model(self, sched_out, prompt_logprob_rows: list[int] | None = None, **kwargs: Any) -> ModelRunnerOutput:
        """Run one step on the workers; returns the driver worker's output (logits of the sampling rows)."""

    @property
    def max_concurrent_batches(self) -> int:
        """Steps that may be submitted before the oldest is collected (1: one step at a time)."""
        return 1

    def submit_model(self, sched_out, prompt_logprob_rows: list[int] | None = None, **kwargs: Any) -> Any:
        """Start one step (arguments as execute_model); returns a handle for collect_model. Steps are
        collected in the order submitted. Default: runs the step now."""
        return self.execute_model(sched_out, prompt_logprob_rows, **kwargs)

    def collect_model(self, handle: Any) -> ModelRunnerOutput:
        """The output of the submitted step `handle` (waits for it); raises what the step raised."""
        return handle

    @abstractmethod
    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run `method` on every worker; returns the results in rank order. Raises AttributeError for a
        method name the workers do not have, before any worker runs anything."""

    def shutdown(self) -> None:
        """Release the workers (nothing to do in process)."""


@register_executor("uni")
class UniProcExecutor(ExecutorBase):
    """One worker, in this process: calls are plain method calls."""

    def __init__(self, config: EngineConfig, model_files) -> None:
        super().__init__(config, model_files)
        self.driver_worker = Worker(config, model_files, rank=0)
        self.workers = [self.driver_worker]

    @property
    def num_kv_blocks(self) -> int:
        return self.driver_worker.num_kv_blocks

    def execute_model(self, sched_out, prompt_logprob_rows: list[int] | None = None, **kwargs: Any) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(sched_out, prompt_logprob_rows, **kwargs)

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        kwargs = kwargs or {}
        check_rpc_method(method)
        if isinstance(method, str):
            return [getattr(w, method)(*args, **kwargs) for w in self.workers]
        return [method(w, *args, **kwargs) for w in self.workers]
