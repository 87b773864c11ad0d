"""Data-parallel serving: two real `pagellm serve` replica processes (the tiny Llama, one CPU each) behind the
front app (dp_app.py) run in a thread here, so the tests can look at its router. Outputs through the front
equal a single replica's (a DP=1 server) for greedy requests; least_loaded spreads concurrent requests; prefix
routing keeps a shared prefix on one replica; a killed replica's stream ends with an error event, /health says
503 naming it, the survivor serves on, and with none left the front answers 503 at once; bad sizes are refused
at start-up before any process starts."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from .conftest import free_port, httpx

pytest.importorskip("pagellm._C", reason="the engine needs the compiled scheduler (run `make install`)")

from pagellm.entrypoints.dp_serve import check_data_parallel, start_replicas, stop_replicas  # noqa: E402
from pagellm.entrypoints.openai.dp_app import build_dp_app  # noqa: E402
from pagellm.entrypoints.openai.dp_router import make_router, prompt_prefix  # noqa: E402
from pagellm.entrypoints.serve import add_serve_args  # noqa: E402
from pagellm.entrypoints.uvicorn_server import GracefulServer  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="needs Linux affinity")


def _serve_args(model_dir, *extra) -> argparse.Namespace:
    return add_serve_args(argparse.ArgumentParser()).parse_args(
        [str(model_dir), "--served-model-name", "m", "--max-model-len", "8192", "--max-num-seqs", "4",
         "--dtype", "float32", "--no-warmup", "--shutdown-timeout", "1", *extra])


class Front:
    """The front app over `replicas` on a free port, in a thread (as run_data_parallel runs it)."""

    def __init__(self, replicas, policy: str) -> None:
        import uvicorn

        self.app = build_dp_app(replicas, make_router(policy, len(replicas)))
        self.router = self.app.state.proxy.router
        self.url = f"http://127.0.0.1:{free_port()}"
        cfg = uvicorn.Config(self.app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]), log_level="warning")
        self.server = GracefulServer(cfg, self.app.state.drain, shutdown_timeout_s=1)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "front did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def replicas(tiny_llama_long_dir):
    reps = start_replicas(_serve_args(tiny_llama_long_dir), 2, startup_timeout_s=120)
    yield reps
    stop_replicas(reps, timeout_s=10)


@pytest.fixture(scope="module")
def front(replicas):
    f = Front(replicas, "least_loaded")
    yield f
    f.stop()


def _complete(url: str, prompt: str, max_tokens: int = 12) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _chat_stream(url: str, content: str) -> tuple[str, list[str]]:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 10, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if json.loads(e).get("choices"))
    return text, events


def test_outputs_equal_a_single_replica(front, replicas):
    single = replicas[0].url  # a replica is a plain DP=1 `pagellm serve`
    for prompt in ("hello there", "once upon a time", "the quick brown fox"):
        assert _complete(front.url, prompt)["choices"][0]["text"] == _complete(single, prompt)["choices"][0]["text"]
    for content in ("hi", "what is two plus two"):
        assert _chat_stream(front.url, content)[0] == _chat_stream(single, content)[0]
    models = httpx.get(front.url + "/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"
    tok = httpx.post(front.url + "/tokenize", json={"model": "m", "prompt": "hello"}, timeout=10)
    assert tok.json() == httpx.post(single + "/tokenize", json={"model": "m", "prompt": "hello"}, timeout=10).json()



def test_a_replica_with_tensor_parallelism_is_its_own_group(replicas, tiny_llama_long_dir):
    """The DP x TP start-up path on this machine's CPUs: one replica started by start_replicas with -tp 2 runs its
    own 2-rank group (its mp executor's own port and segments) beside the 2 DP replicas' engines, and answers
    as a TP=1 replica does (greedy, float32)."""
    allowed = len(__import__("os").sched_getaffinity(0))
    if allowed < 2:
        pytest.skip(f"needs 2 CPUs for 2 ranks, this process may use {allowed}")
    (tp_replica,) = start_replicas(_serve_args(tiny_llama_long_dir, "-tp", "2"), 1, startup_timeout_s=180)
    try:
        front = Front([tp_replica], "least_loaded")
        try:
            for prompt in ("hello there", "the quick brown fox"):
                got = _complete(front.url, prompt)["choices"][0]["text"]
                assert got == _complete(replicas[0].url, prompt)["choices"][0]["text"]
        finally:
            front.stop()
    finally:
        stop_replicas([tp_replica], timeout_s=10)
    assert tp_replica.proc.returncode is not None

def test_least_loaded_spreads_concurrent_requests(front):
    before = list(front.router.routed)
    threads = [threading.Thread(target=_complete, args=(front.url, f"request {i}", 40)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    sent = [a - b for a, b in zip(front.router.routed, before)]
    assert sum(sent) == 6 and min(sent) >= 2, sent
    assert front.router.in_flight == [0, 0]
    metrics = httpx.get(front.url + "/metrics", timeout=10).text
    assert 'replica="0"' in metrics and 'replica="1"' in metrics
    assert 'pagellm_dp_replica_up{replica="1"} 1' in metrics
    assert metrics.count("# TYPE pagellm_dp_replica_up ") == 1
    assert httpx.get(front.url + "/health", timeout=10).json()["status"] == "ok"


def test_prefix_routing_keeps_a_shared_prefix_on_one_replica(replicas):
    f = Front(replicas, "prefix")
    try:
        system = "You are a helpful assistant. " * 12  # longer than the hashed prefix
        threads = [threading.Thread(target=_complete, args=(f.url, system + f"question {i}", 20)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(f.router.routed) == [0, 4], f.router.routed
        assert prompt_prefix({"prompt": system + "a"}, 256) == prompt_prefix({"prompt": system + "b"}, 256)
        chat = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "x"}]}
        assert prompt_prefix(chat, 256) == prompt_prefix({**chat, "messages": chat["messages"][:1]}, 256)
    finally:
        f.stop()


def test_bad_sizes_are_refused_before_anything_starts(tiny_llama_dir):
    args = _serve_args(tiny_llama_dir)
    with pytest.raises(ValueError, match="more than the 2 CPUs"):
        check_data_parallel(3, args, allowed_cpus=2)
    with pytest.raises(ValueError, match=r"data_parallel_size x tensor_parallel_size x pipeline_parallel_size "
                                         r"\(2 x 2 x 1 = 4 ranks\) is more than the 3 CPUs"):
        check_data_parallel(2, _serve_args(tiny_llama_dir, "-tp", "2"), allowed_cpus=3)
    check_data_parallel(2, _serve_args(tiny_llama_dir, "-tp", "2"), allowed_cpus=4)  # one CPU per rank: fine
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_router("random", 2)
    too_many = len(__import__("os").sched_getaffinity(0)) + 1
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(tiny_llama_dir),
                           "--data-parallel-size", str(too_many)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"data_parallel_size ({too_many}) is more than" in proc.stderr, proc.stderr
    assert time.time() - t0 < 60
    with pytest.raises(SystemExit):
        add_serve_args(argparse.ArgumentParser()).parse_args([str(tiny_llama_dir), "--data-parallel-size", "0"])


def _metric(url: str, name: str, label: str = "") -> float:
    """A replica's metric `name`, summed over its samples (those with `label` in them)."""
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines
               if (x.startswith(name + "{") or x.startswith(name + " ")) and label in x)


def _running(url: str) -> float:
    return _metric(url, "pagellm:num_requests_running")


def test_client_disconnect_aborts_the_replica_request(front, replicas):
    """The client leaves after 50 tokens: the replica's request ends far sooner than the rest of its 8000 tokens
    would take at the rate they were streaming."""
    body = {"model": "m", "prompt": "go on", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    stamps = []
    with httpx.stream("POST", front.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                stamps.append(time.time())
            if len(stamps) == 50:
                break  # the client goes away
    rest_s = (stamps[-1] - stamps[0]) / 49 * (8000 - 50)
    t0 = time.time()
    while sum(front.router.in_flight) or any(_running(rep.url) for rep in replicas):
        assert time.time() - t0 < max(rest_s / 4, 0.5), f"the replica kept generating ({rest_s:.1f} s left)"
        time.sleep(0.05)


def _long_stream(url: str, first: threading.Event, out: dict) -> None:
    body = {"model": "m", "prompt": "a long story", "max_tokens": 6000, "ignore_eos": True, "stream": True}
    out["events"] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                out["events"].append(line[6:])
                first.set()


def test_killed_replica_fails_cleanly_and_the_front_serves_on(front, replicas):
    """Runs last in the module: it kills the replicas."""
    firsts, outs = [threading.Event(), threading.Event()], [{}, {}]
    threads = [threading.Thread(target=_long_stream, args=(front.url, e, o), daemon=True) for e, o in zip(firsts, outs)]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in firsts), "a stream produced nothing"
    assert front.router.in_flight == [1, 1]
    replicas[1].proc.send_signal(signal.SIGKILL)
    replicas[1].proc.wait(10)
    deadline = time.time() + 30
    while front.router.in_flight[1]:  # the killed replica's stream ends at once, not at the generation's end
        assert time.time() < deadline, "the dead replica's stream did not end"
        time.sleep(0.05)
    health = httpx.get(front.url + "/health", timeout=10)
    assert health.status_code == 503 and "replica 1" in health.json()["message"], health.text
    assert _complete(front.url, "still there?")["choices"][0]["text"]  # replica 0 serves on
    replicas[0].proc.send_signal(signal.SIGKILL)
    replicas[0].proc.wait(10)
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    for out in outs:  # each stream: 200, some tokens, then the error event and [DONE]
        assert out["status"] == 200 and out["events"][-1] == "[DONE]", out["events"][-2:]
        assert json.loads(out["events"][-2])["error"]["type"] == "ServiceUnavailableError"
    t0 = time.time()
    r = httpx.post(front.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and "no replica is serving" in r.json()["error"]["message"]
    assert time.time() - t0 < 5


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_serve_command_runs_replicas_and_sigterm_stops_them(tiny_llama_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(tiny_llama_dir),
                             "--port", str(port), "--served-model-name", "m", "--dtype", "float32", "--no-warmup",
                             "--data-parallel-size", "2", "--dp-routing", "prefix", "--api-key", "k",
                             "--shutdown-timeout", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the data-parallel server did not start"
            time.sleep(0.2)
        children = _children(proc.pid)
        assert len(children) == 2
        body = {"model": "m", "prompt": "hi", "max_tokens": 4, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401  # the front checks
        ok = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer k"}, timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stdout.read()
        for pid in children:  # the replicas were stopped with the front
            assert not __import__("os").path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
