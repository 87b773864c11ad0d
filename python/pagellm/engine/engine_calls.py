"""Calls into the engine from the event loop, run on the engine thread between steps (AsyncLLM).

The engine is not thread-safe: an admin operation (update weights, sleep, wake) must not run while a step
does. `EngineCallQueue.post` queues `fn(engine)` and returns an asyncio future; the engine thread runs
what is queued when it drains its inbox (`run_pending`) and resolves the futures on their loop.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


def _resolve(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller went away (cancelled)
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class EngineCallQueue:
    """Thread-safe queue of (fn, future, loop); `run_pending` on the engine thread, `post` from a loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[tuple[Callable[[Any], Any], asyncio.Future, asyncio.AbstractEventLoop]] = []

    def post(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._calls.append((fn, fut, loop))
        return fut

    def run_pending(self, engine) -> None:
        """Run every queued call in order; each call's exception goes to its own future only."""
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, fut, loop in calls:
            try:
                result, error = fn(engine), None
            except Exception as e:  # noqa: BLE001 - the caller gets it
                result, error = None, e
            try:
                loop.call_soon_threadsafe(_resolve, fut, result, error)
            except RuntimeError:  # that loop is closed: nobody is waiting
                pass

    def fail_pending(self, error: BaseException) -> None:
        """Fail every queued call (the engine loop died or shut down)."""
        with self._lock:
            calls, self._calls = self._calls, []
        for _, fut, loop in calls:
            try:
                loop.call_soon_threadsafe(_resolve, fut, None, error)
            except RuntimeError:
                pass
