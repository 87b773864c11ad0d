"""`pagellm serve` as a real process: SIGTERM with streams still open stops it within seconds (uvicorn's
graceful period, then the in-flight requests are cancelled and the engine thread stops), rather than
generating on for minutes for clients that will never read the tokens."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from .conftest import free_port, httpx

pytest.importorskip("pagellm._C", reason="the engine needs the compiled scheduler (run `make install`)")


def _stream(url: str, got_first: threading.Event, chunks: list[int]) -> None:
    body = {"model": "m", "prompt": "once upon a time", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    json.loads(line[6:])
                    chunks[0] += 1
                    got_first.set()
    except httpx.HTTPError:
        pass  # the server went away: expected


def test_sigterm_stops_a_busy_server(tiny_llama_long_dir):
    model = tiny_llama_long_dir
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagellm.entrypoints.serve", str(model), "--port", str(port),
         "--served-model-name", "m", "--max-model-len", "8192", "--max-num-seqs", "8", "--dtype", "float32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not start"
            time.sleep(0.2)
        events = [threading.Event() for _ in range(6)]
        counts = [[0] for _ in events]
        threads = [threading.Thread(target=_stream, args=(url, e, c), daemon=True) for e, c in zip(events, counts)]
        for t in threads:
            t.start()
        for e in events:
            assert e.wait(60), "a stream produced no token"
        # 6 x 8000 tokens is far more work than the grace period: only cancelling them ends the process quickly.
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        stopped_after = time.time() - t0
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads), "a client stream did not end after the server stopped"
        assert all(c[0] < 8000 for c in counts)  # the streams were cut, not served to the end
        assert stopped_after < 30, f"the server took {stopped_after:.1f} s to stop"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
