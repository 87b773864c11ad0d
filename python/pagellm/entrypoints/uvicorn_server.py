"""uvicorn with a graceful shutdown: the first SIGTERM / SIGINT drains the app (its ServerDrain: new
requests get 503 + Retry-After, in-flight ones get `shutdown_timeout_s` to finish, then the rest are ended
and their clients told), and only then does uvicorn close its sockets; the process exits 0. A second
signal stops at once.

    server = GracefulServer(uvicorn.Config(app, ...), app.state.drain, shutdown_timeout_s=30)
    server.run()
"""

from __future__ import annotations

import asyncio
import signal

import uvicorn

from pagellm.entrypoints.openai.drain import DrainReport, ServerDrain
from pagellm.logger import init_logger

logger = init_logger(__name__)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: ServerDrain, shutdown_timeout_s: float = 30.0) -> None:
        if shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {shutdown_timeout_s}")
        super().__init__(config)
        self.drain = drain
        self.shutdown_timeout_s = shutdown_timeout_s
        self.drain_report: DrainReport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None  # held so it is not garbage-collected

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """A signal handler (main thread), or a call from any thread (tests). Never re-raises the signal
        after the shutdown, as uvicorn would: a drained server exits 0."""
        loop = self._loop
        if not self._drain_requested and not self.should_exit and loop is not None and self.started:
            logger.info("%s: draining (up to %.0f s for requests in flight)", signal.Signals(sig).name,
                        self.shutdown_timeout_s)
            self._drain_requested = True
            loop.call_soon_threadsafe(self._start_drain)
            return
        if self.should_exit or self._drain_requested:
            self.force_exit = True  # a second signal: stop waiting
        self.should_exit = True

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            self.drain_report = await self.drain.drain(self.shutdown_timeout_s)
            r = self.drain_report
            logger.info("drained in %.1f s: %d requests finished, %d ended at the deadline", r.seconds,
                        r.num_finished, r.num_cut)
        finally:
            self.should_exit = True
