"""`pagellm serve` as a real process, SIGTERM with streams still open: the server drains (new requests get
503 + Retry-After, /health says draining), gives the requests in flight --shutdown-timeout to finish, then
ends each open stream with a final error event and `data: [DONE]` (its engine requests aborted) and exits 0
within seconds, rather than generating on for minutes for clients that will never read the tokens, or
cutting streams without a word."""

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

SHUTDOWN_TIMEOUT_S = 2


def _stream(url: str, got_first: threading.Event, result: dict) -> None:
    body = {"model": "m", "prompt": "once upon a time", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    result["events"] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    result["events"].append(line[6:])
                    got_first.set()
    except httpx.HTTPError as e:
        result["error"] = repr(e)


def _wait_healthy(proc, url: str) -> None:
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "server did not start"
        time.sleep(0.2)


def test_sigterm_drains_a_busy_server_and_tells_every_stream(tiny_llama_long_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagellm.entrypoints.serve", str(tiny_llama_long_dir), "--port", str(port),
         "--served-model-name", "m", "--max-model-len", "8192", "--max-num-seqs", "8", "--dtype", "float32",
         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(proc, url)
        events = [threading.Event() for _ in range(6)]
        results = [{} for _ in events]
        threads = [threading.Thread(target=_stream, args=(url, e, r), daemon=True) for e, r in zip(events, results)]
        for t in threads:
            t.start()
        for e in events:
            assert e.wait(60), "a stream produced no token"
        # 6 x 8000 tokens is far more work than the shutdown timeout: only ending them stops the process soon.
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        while httpx.get(url + "/health", timeout=5).status_code == 200:
            assert time.time() - t0 < 10, "SIGTERM did not start a drain"
            time.sleep(0.02)
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        late = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 4}, timeout=5)
        assert late.status_code == 503 and int(late.headers["retry-after"]) > 0
        assert late.json()["error"]["type"] == "ServiceUnavailableError"
        returncode = proc.wait(timeout=60)
        stopped_after = time.time() - t0
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads), "a client stream did not end after the server stopped"
        assert returncode == 0, proc.stdout.read()
        assert SHUTDOWN_TIMEOUT_S <= stopped_after < SHUTDOWN_TIMEOUT_S + 20, stopped_after
        for r in results:
            assert r.get("status") == 200 and "error" not in r, r.get("error")
            evs = r["events"]
            assert evs[-1] == "[DONE]", evs[-3:]
            final = json.loads(evs[-2])
            assert final["error"]["type"] == "ServiceUnavailableError", final
            assert 1 < len(evs) - 2 < 8000  # tokens streamed, and the stream was cut, not served to the end
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
