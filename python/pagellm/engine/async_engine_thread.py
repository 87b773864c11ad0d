"""AsyncLLM's stage 2: the engine thread (drain the inbox, step, hand the outputs to the event loop), and
the errors its clients see. A mixin of AsyncLLM (async_llm.py), which owns the state it reads: engine,
_loop, the inbox (_inbox_lock, _pending_adds, _pending_aborts, _wake), _engine_calls, _stopped, _dead,
stats and the step counters; and the event-loop callbacks it posts (_dispatch, _fail_some, _fail_all)."""

from __future__ import annotations

import asyncio
import ctypes
import time

from pagellm.logger import init_logger
from pagellm.outputs import RequestOutput

logger = init_logger(__name__)


def release_freed_heap() -> None:
    """glibc keeps freed heap pages (a long prompt's activations, say) in its arenas, so a server's RSS
    only ever grows; malloc_trim(0) returns them. A no-op where glibc is not the allocator."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class EngineDeadError(RuntimeError):
    """The engine loop crashed; the server should report unhealthy and be restarted."""


class EngineStepError(RuntimeError):
    """The engine step running this request failed; the request is finished, the engine goes on.
    `output` is the request's final RequestOutput (finish_reason "error", `error` set)."""

    def __init__(self, message: str, output: RequestOutput | None = None) -> None:
        super().__init__(message)
        self.output = output


class QueueFullError(RuntimeError):
    """More requests are waiting than max_queue_len allows (HTTP 429)."""


class EngineThreadMixin:
    """The engine thread's loop; only this thread touches the (not thread-safe) engine."""

    def _engine_loop(self) -> None:
        """Drain the inbox, step, hand outputs over; until shut down or the engine cannot go on (its
        step raised: LLMEngine.step fails a faulty step's requests itself and raises only when it
        could not recover), which marks this AsyncLLM dead and fails every stream."""
        loop = self._loop
        assert loop is not None
        self._refresh_stats()
        busy = False
        try:
            while not self._stopped.is_set():
                self._drain_inbox(loop)
                if self.engine.has_unfinished_requests():
                    busy = True
                    self._step_once(loop)
                else:
                    if busy:  # just went idle: hand the heap the steps freed back to the OS
                        busy = False
                        release_freed_heap()
                    self._refresh_stats()
                    self._wake.wait(self._idle_poll_s)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - report any crash to every client
            logger.exception("engine loop crashed; AsyncLLM is dead")
            self._dead = e
            try:
                loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine loop died: {e!r}"))
            except RuntimeError:
                pass

    def _drain_inbox(self, loop: asyncio.AbstractEventLoop) -> None:
        """Apply the posted adds and aborts; a request the engine refuses fails its stream only."""
        engine = self.engine
        with self._inbox_lock:
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, []
        failed: list[tuple[str, BaseException]] = []
        for rid, req, arrival, prio, lora_request in adds:
            if rid in aborts:
                continue  # cancelled before it ever reached the engine
            try:
                engine.add_request(rid, req.as_prompt(), req.params, arrival_time=arrival, priority=prio,
                                   **({"lora_request": lora_request} if lora_request is not None else {}))
            except Exception as e:  # bad request: the engine is unchanged, fail that stream only
                failed.append((rid, e))
        if aborts:
            engine.abort_request(aborts)
        if failed:
            loop.call_soon_threadsafe(self._fail_some, failed)
        self._engine_calls.run_pending(engine)  # after the adds: sleep() sees every admitted request

    def _step_once(self, loop: asyncio.AbstractEventLoop) -> None:
        t0 = time.perf_counter()
        outputs = self.engine.step()
        self.step_time_total += time.perf_counter() - t0
        self.num_steps += 1
        self._refresh_stats(after_step=True)
        if outputs:
            self.num_output_batches += 1
            loop.call_soon_threadsafe(self._dispatch, outputs)

    def _refresh_stats(self, after_step: bool = False) -> None:
        try:
            stats = self.engine.get_stats()
            if after_step:
                stats.num_steps = self.num_steps
            self.stats = stats
        except Exception:  # noqa: BLE001 - stats are best-effort
            pass
