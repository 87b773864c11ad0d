"""The "mp" executor: tensor_parallel_size x pipeline_parallel_size worker processes on this host, started
and supervised here.

    driver (engine, scheduler, block manager)
       │ one pickled message per call, written to every rank's pipe: the step's SchedulerOutput (a
       │ SchedulerOutputSnapshot) + the same kwargs UniProcExecutor passes; replies read back
       ▼
    rank 0 … rank tp*pp-1  (mp_worker.py: a Worker each, one gloo world; all-reduces inside a stage's
                            forward, activations sent stage to stage; the last stage's output is the step's)

Pipeline micro-batches (pipeline_parallel_size > 1, pipeline_microbatching): `submit_model` writes a step to
every rank and returns without waiting, so stage 0 starts step k+1 while the last stage still runs step k.
Every call (step or collective_rpc) joins one FIFO of outstanding calls; each rank answers its calls in order
(pp > 1: a thread on the rank reads the pipe ahead, so the driver's writes never wait on a busy rank), so the
replies are matched to calls by position, oldest first: `collect_model` of a later step, or a collective_rpc,
first reads the replies of the calls before it.

Supervision: every wait has a deadline (PAGELLM_MP_STEP_TIMEOUT_S, default 300 s; start-up 2x) and
watches the processes' sentinels. A rank that dies fails the call with `WorkerDiedError` naming the rank,
its pid and exit code; the executor is then broken (every later call raises the same error at once), the
other ranks are stopped, and the engine's step recovery fails the step's requests. `shutdown()` (also run
when the executor is collected or the interpreter exits) stops and reaps every process.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import weakref
from collections import deque
from dataclasses import dataclass, replace
from multiprocessing import connection
from typing import Any, Callable

import torch.multiprocessing as torch_mp

from pagellm.config import EngineConfig
from pagellm.distributed.shm_comm import allreduce_backend, new_segment_name, unlink_segments
from pagellm.distributed.validation import check_pipeline_parallel, check_tensor_parallel, cpu_slices
from pagellm.engine.executor import ExecutorBase, check_rpc_method, register_executor
from pagellm.engine.model_runner import ModelRunnerOutput
from pagellm.distributed.rank_groups import output_rank
from pagellm.engine.mp_worker import STEP_TIMEOUT_ENV, SchedulerOutputSnapshot, worker_main
from pagellm.logger import init_logger

logger = init_logger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker process exited (or stopped answering) while the executor needed it; the executor is unusable."""


@dataclass
class _OutstandingCall:
    """A call written to every rank whose replies are not read yet (filled in by `_wait`)."""

    what: str
    replies: list | None = None
    error: BaseException | None = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_processes(procs: list, conns: list, grace_s: float = 5.0, shm_name: str | None = None,
                    pp_size: int = 1) -> None:
    """Ask, then terminate, then kill; join every process (no zombies left behind); then remove the
    shared-memory segment names a rank that died during set-up may have left."""
    for c in conns:
        try:
            c.send_bytes(pickle.dumps(None))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for c in conns:
        c.close()
    if shm_name is not None:
        unlink_segments(shm_name, pp_size)


def per_rank_config(config: EngineConfig, tp_size: int) -> EngineConfig:
    """The ranks share this host's memory: each sizes its KV cache (1/tp of the heads) from 1/tp of the
    budget (kv_cache_memory_gb, or the free-memory fraction), so TP=2 holds as many tokens as TP=1 in the
    same memory. An explicit num_kv_blocks is every rank's. With pipeline stages pass the world size
    tp * pp (a stage holds 1/pp of the layers, so 1/(tp*pp) of the budget fits as many blocks)."""
    cc = config.cache_config
    if tp_size == 1 or cc.num_kv_blocks is not None:
        return config
    gb = None if cc.kv_cache_memory_gb is None else cc.kv_cache_memory_gb / tp_size
    return replace(config, cache_config=replace(cc, kv_cache_memory_gb=gb, kv_cache_fraction=cc.kv_cache_fraction / tp_size))


@register_executor("mp")
class MultiprocExecutor(ExecutorBase):
    """tensor_parallel_size x pipeline_parallel_size ranks in worker processes (global rank = pp_rank * tp +
    tp_rank); the output of tp rank 0 of the last stage is the step's output."""

    def __init__(self, config: EngineConfig, model_files) -> None:
        super().__init__(config, model_files)
        pc, mc = config.parallel_config, config.model_config
        self.tp_size = pc.tensor_parallel_size
        self.pp_size = getattr(pc, "pipeline_parallel_size", 1)
        self.world_size = self.tp_size * self.pp_size
        self.output_rank = output_rank(self.tp_size, self.pp_size)
        allowed = sorted(os.sched_getaffinity(0))
        check_pipeline_parallel(self.pp_size, self.tp_size, model_files.hf_config, device=mc.device,
                                speculative_config=config.speculative_config, allowed_cpus=len(allowed))
        check_tensor_parallel(self.tp_size, model_files.hf_config, device=mc.device, allowed_cpus=len(allowed))
        self.step_timeout_s = float(os.environ.get(STEP_TIMEOUT_ENV, "300"))
        microbatching = self.pp_size > 1 and getattr(pc, "pipeline_microbatching", True)
        self._max_concurrent_batches = self.pp_size if microbatching else 1
        self._outstanding: deque[_OutstandingCall] = deque()  # written to every rank, replies not read yet
        # every rank is on this host: the TP all-reduce goes through shared memory unless gloo is forced
        shm_name = new_segment_name() if self.tp_size > 1 and allreduce_backend() == "shm" else None
        self._broken: WorkerDiedError | None = None
        ctx = torch_mp.get_context("spawn")
        files = replace(model_files, tokenizer=None)  # the ranks never tokenize
        rank_config = per_rank_config(config, self.world_size)
        port, slices = _free_port(), cpu_slices(allowed, self.world_size)
        self.procs, self.conns = [], []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"pagellm-rank{rank}", daemon=True,
                               args=(rank, self.tp_size, port, slices[rank], rank_config, files, child, self.pp_size,
                                     shm_name))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs, self.conns, 5.0, shm_name, self.pp_size)
        try:
            blocks = self._gather(range(self.world_size), 2 * self.step_timeout_s, "start-up")
        except BaseException:
            self.shutdown()
            raise
        self._num_kv_blocks = min(blocks)  # every rank holds the same geometry; the scheduler's budget is one number
        logger.info("mp executor: %d ranks (tp %d x pp %d, pids %s), %d KV blocks each", self.world_size,
                    self.tp_size, self.pp_size,
                    [p.pid for p in self.procs], self._num_kv_blocks)

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    @property
    def max_concurrent_batches(self) -> int:
        """pipeline_parallel_size with micro-batching (one step per stage in flight), else 1."""
        return self._max_concurrent_batches

    @property
    def broken_error(self) -> WorkerDiedError | None:
        """Why the executor cannot run calls any more (a rank died or stopped answering); None while healthy."""
        return self._broken

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ---- calls -----------------------------------------------------------------------------------------
    def execute_model(self, sched_out, prompt_logprob_rows: list[int] | None = None, **kwargs: Any) -> ModelRunnerOutput:
        return self.collect_model(self.submit_model(sched_out, prompt_logprob_rows, **kwargs))

    def submit_model(self, sched_out, prompt_logprob_rows: list[int] | None = None, **kwargs: Any) -> _OutstandingCall:
        """Write the step to every rank and return at once (the snapshot is taken now)."""
        snapshot = sched_out if isinstance(sched_out, SchedulerOutputSnapshot) else SchedulerOutputSnapshot.of(sched_out)
        return self._send_all("execute_model", (snapshot, prompt_logprob_rows), kwargs, reply_with_result=False)

    def collect_model(self, handle: _OutstandingCall) -> ModelRunnerOutput:
        return self._wait(handle)[self.output_rank]

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        check_rpc_method(method)
        return self._wait(self._send_all(method, tuple(args), dict(kwargs or {}), reply_with_result=True))

    def _send_all(self, method, args: tuple, kwargs: dict, reply_with_result: bool) -> _OutstandingCall:
        if self._broken is not None:
            raise self._broken
        try:
            payload = pickle.dumps((method, args, kwargs, reply_with_result))
        except Exception as e:  # noqa: BLE001 - e.g. a lambda: nothing was sent
            raise TypeError(f"the mp executor sends calls to worker processes by pickle; {method!r} with its "
                            f"arguments does not pickle ({e}); use a module-level function") from None
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                self._fail_outstanding(self._mark_broken(rank, "while receiving a call"))
                raise self._broken from None
        call = _OutstandingCall(f"call {getattr(method, '__name__', method)!r}")
        self._outstanding.append(call)
        return call

    def _wait(self, call: _OutstandingCall) -> list[Any]:
        """`call`'s replies in rank order, reading (and keeping for their callers) those of older calls first;
        raises what a rank raised for it, or WorkerDiedError (then every outstanding call fails with it)."""
        while call.replies is None and call.error is None:
            oldest = self._outstanding[0]
            try:
                oldest.replies = self._gather(range(self.world_size), self.step_timeout_s, oldest.what)
            except WorkerDiedError as e:
                self._fail_outstanding(e)
                break
            except Exception as e:  # noqa: BLE001 - a rank raised: this call fails, the ranks go on
                oldest.error = e
            self._outstanding.popleft()
        if call.error is not None:
            raise call.error
        return call.replies

    def _fail_outstanding(self, error: WorkerDiedError) -> None:
        for c in self._outstanding:
            c.error = error
        self._outstanding.clear()

    def _gather(self, ranks, timeout_s: float, what: str) -> list[Any]:
        """Every rank's reply, in rank order; raises a rank's exception after all replied, WorkerDiedError
        when one dies or the deadline passes (then the executor is broken)."""
        pending, replies = set(ranks), {}
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._mark_broken(min(pending), f"during {what}: no reply within {timeout_s:.0f} s "
                                        f"({STEP_TIMEOUT_ENV})")
            # a rank that answered with an error may exit (a failed start-up): only the others' exits count
            watched = [r for r in range(self.world_size) if replies.get(r, ("ok",))[0] != "error"]
            waitables = {self.conns[r]: r for r in pending} | {self.procs[r].sentinel: r for r in watched}
            for ready in connection.wait(list(waitables), timeout=min(remaining, 1.0)):
                rank = waitables[ready]
                if ready is self.procs[rank].sentinel:
                    if rank not in pending:  # it answered, then died
                        raise self._mark_broken(rank, f"during {what}")
                    continue  # its pipe is readable too: a last reply, or EOF (read below / next round)
                try:
                    replies[rank] = pickle.loads(ready.recv_bytes())
                except (EOFError, OSError):
                    self.procs[rank].join(1.0)
                    raise self._mark_broken(rank, f"during {what}") from None
                pending.discard(rank)
                if replies[rank][0] == "error":  # the others may wait in a collective for this rank: bound it
                    deadline = min(deadline, time.monotonic() + 30.0)
        for rank in sorted(replies):
            status, value, *text = replies[rank]
            if status == "error":
                logger.error("rank %d failed during %s:\n%s", rank, what, text[0] if text else "")
                raise value
        return [replies[r][1] for r in sorted(replies)]

    def _mark_broken(self, rank: int, when: str) -> WorkerDiedError:
        proc = self.procs[rank]
        code = proc.exitcode
        state = f"exited with code {code}" if code is not None else "stopped answering"
        self._broken = WorkerDiedError(f"worker rank {rank} (pid {proc.pid}) {state} {when}; "
                                       f"the mp executor is unusable (its other ranks were stopped)")
        logger.error("%s", self._broken)
        self.shutdown()
        return self._broken

    def shutdown(self) -> None:
        """Stop and reap every worker process (idempotent)."""
        self._finalizer()
