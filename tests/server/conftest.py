"""Server fixtures: a real uvicorn server on a free loopback port, in a thread of this process (so
tests can look at the engine's free-block count), in front of the fake engine or the real one."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from pagellm.engine.async_llm import AsyncLLM  # noqa: E402
from pagellm.entrypoints.openai.api_server import build_app  # noqa: E402
from pagellm.entrypoints.uvicorn_server import GracefulServer  # noqa: E402

from .fake_engine import FakeEngine  # noqa: E402


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerHandle:
    """app_kwargs go to build_app (max_request_bytes, metrics_require_auth); the server drains on
    `sigterm()` as `pagellm serve` does on SIGTERM, with shutdown_timeout_s for requests in flight."""

    def __init__(self, engine, model_name="test-model", api_key=None, max_queue_len=None, app_kwargs=None,
                 shutdown_timeout_s=30.0, **llm_kwargs):
        import uvicorn

        self.engine = engine
        self.llm = AsyncLLM(engine, **llm_kwargs)
        self.app = build_app(self.llm, model_name, api_key=api_key, max_queue_len=max_queue_len,
                             **(app_kwargs or {}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model_name
        cfg = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                             timeout_graceful_shutdown=2)
        self.server = GracefulServer(cfg, self.app.state.drain, shutdown_timeout_s=shutdown_timeout_s)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    def sigterm(self):
        """What a SIGTERM does to `pagellm serve` (signal handlers only run in the main thread)."""
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.llm.shutdown()


@pytest.fixture(scope="module")
def fake_server():
    h = ServerHandle(FakeEngine(max_model_len=256, max_num_seqs=8, step_time=0.002))
    yield h
    h.stop()


def wait_blocks_free(engine, timeout=10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if engine.num_free_blocks == engine.num_total_blocks and not engine.has_unfinished_requests():
            return True
        time.sleep(0.02)
    return False
