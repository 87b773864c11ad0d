"""Graceful shutdown of the server: refuse new work, let in-flight requests finish, then end the rest and
tell their clients.

    drain = ServerDrain()                       # app.state.drain (build_app); DrainMiddleware counts requests
    report = await drain.drain(timeout_s=30)    # on SIGTERM (entrypoints/uvicorn_server.py), then exit

While draining, every request but those to `open_paths` (/health answers 503 "draining" itself, /metrics
keeps answering) gets 503 + Retry-After. Requests in flight get `timeout_s` to finish; then each is
cancelled (closing its output stream aborts its engine requests, freeing their KV blocks) and its client
told: a stream that has started gets a final SSE error event and `data: [DONE]`, a response that has not
started gets a 503 JSON error.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.openai.middleware import route_path
from pagellm.entrypoints.openai.serving_base import SSE_DONE, error_body, sse

RETRY_AFTER_S = 5
_SHUTTING_DOWN = "The server is shutting down; retry the request (another replica, or this one once it is back)."
_CUT = "The server is shutting down: this request was ended before it finished."


@dataclass
class DrainReport:
    """What a drain did: requests that finished by themselves, and those ended at the deadline."""

    num_finished: int = 0
    num_cut: int = 0
    seconds: float = 0.0


@dataclass(eq=False)
class _InFlight:
    task: asyncio.Task
    started: bool = False       # the response's status line went out
    completed: bool = False     # ... and its last body part
    is_sse: bool = False
    cut: bool = False


@dataclass
class ServerDrain:
    """The server's shutdown state; all of it is touched on the event loop only."""

    retry_after_s: int = RETRY_AFTER_S
    draining: bool = False
    in_flight: set = field(default_factory=set)   # of _InFlight

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def refusal(self) -> JSONResponse:
        return JSONResponse(error_body(_SHUTTING_DOWN, "ServiceUnavailableError", None, "shutting_down"),
                            status_code=503, headers={"Retry-After": str(self.retry_after_s)})

    async def drain(self, timeout_s: float, cut_grace_s: float = 5.0) -> DrainReport:
        """Stop accepting; wait up to timeout_s for the requests in flight; end those still running."""
        t0 = time.monotonic()
        self.draining = True
        before = self.num_in_flight
        await self._wait_idle(timeout_s)
        report = DrainReport(num_cut=self.num_in_flight)
        report.num_finished = max(0, before - report.num_cut)
        for rec in list(self.in_flight):
            rec.cut = True
            rec.task.cancel()
        await self._wait_idle(cut_grace_s)
        report.seconds = time.monotonic() - t0
        return report

    async def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


class DrainMiddleware:
    """Counts the requests in flight for `drain`, refuses new ones while it drains, and tells the clients
    of requests cut at the deadline (see the module docstring)."""

    def __init__(self, app: ASGIApp, drain: ServerDrain, open_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.drain = drain
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in self.open_paths:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await self.drain.refusal()(scope, receive, send)
            return
        rec = None

        async def watching_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                rec.started = True
                rec.is_sse = _is_event_stream(message)
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                rec.completed = True
            await send(message)

        rec = _InFlight(asyncio.ensure_future(self.app(scope, receive, watching_send)))
        self.drain.in_flight.add(rec)
        try:
            await rec.task
        except asyncio.CancelledError:
            if not rec.cut or not rec.task.cancelled():
                raise  # our own task was cancelled (uvicorn's forced shutdown), not a drain cut
            await _tell_cut(rec, scope, receive, send, self.drain)
        finally:
            self.drain.in_flight.discard(rec)


def _is_event_stream(start: Message) -> bool:
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip().lower() == b"text/event-stream"
    return False


async def _tell_cut(rec: _InFlight, scope: Scope, receive: Receive, send: Send, drain: ServerDrain) -> None:
    try:
        if not rec.started:
            body = error_body(_CUT, "ServiceUnavailableError", None, "shutting_down")
            await JSONResponse(body, status_code=503,
                               headers={"Retry-After": str(drain.retry_after_s)})(scope, receive, send)
        elif rec.is_sse and not rec.completed:
            event = sse(error_body(_CUT, "ServiceUnavailableError", None, "shutting_down"))
            await send({"type": "http.response.body", "body": (event + SSE_DONE).encode(), "more_body": False})
    except OSError:
        pass  # the client is gone already
