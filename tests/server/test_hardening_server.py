"""The server refuses bad input cleanly and shuts down gracefully: one test per item of the hardening
report (numbered as there), each against the fake engine in a real uvicorn server:
2 lone surrogates, 3 validation before a stream starts, 4 body cap and prompt length before tokenizing,
5 short error bodies, 6 auth on every route, 8 OpenAPI / health / 405, 9 drain on SIGTERM."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from .conftest import ServerHandle, wait_blocks_free
from .fake_engine import FakeEngine

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def good(h) -> None:
    r = httpx.post(h.url + COMPLETIONS, json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def assert_error(r: httpx.Response, status: int, type_: str | None = None) -> dict:
    """A JSON error answer (never an event stream), with the OpenAI error shape."""
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if type_ is not None:
        assert err["type"] == type_, err
    return err


def post_raw(h, path: str, raw: bytes, **kw) -> httpx.Response:
    return httpx.post(h.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30, **kw)


def sse_lines(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


# ------------------------------------------------------------------------------------------------ 2
LONE_SURROGATE_BODIES = [
    (COMPLETIONS, rb'{"prompt": "ab\ud800c"}', "prompt"),
    (COMPLETIONS, rb'{"prompt": ["ok", "\udc00"]}', "prompt.1"),
    (COMPLETIONS, rb'{"prompt": "ok", "stop": ["x\ud800"]}', "stop.0"),
    (CHAT, rb'{"messages": [{"role": "user", "content": "hi \ud83d"}]}', "messages.0.content"),
    (CHAT, rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}',
     "messages.0.content.0.text"),
    ("/tokenize", rb'{"prompt": "\ud800"}', "prompt"),
    ("/tokenize", rb'{"messages": [{"role": "u\ud800", "content": "x"}]}', "messages.0.role"),
]


@pytest.mark.parametrize("path,raw,where", LONE_SURROGATE_BODIES)
def test_2_lone_surrogate_is_a_400(fake_server, path, raw, where):
    """JSON "\\ud800" without its pair decodes to a string no tokenizer or UTF-8 encoder takes: a 400 naming
    where it is (it was a 500), and the server is fine after it."""
    err = assert_error(post_raw(fake_server, path, raw), 400, "BadRequestError")
    assert "surrogate" in err["message"] and where in err["message"], err
    good(fake_server)


def test_2_valid_surrogate_pairs_are_accepted(fake_server):
    r = post_raw(fake_server, COMPLETIONS, rb'{"prompt": "smile \ud83d\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len("smile \U0001F600")  # one char per token (fake tokenizer)


# ------------------------------------------------------------------------------------------------ 3
def _stream_bodies(extra: dict) -> list[tuple[str, dict]]:
    return [(COMPLETIONS, {"prompt": "hello", "stream": True, "max_tokens": 4, **extra}),
            (CHAT, {"messages": [{"role": "user", "content": "hello"}], "stream": True, "max_tokens": 4, **extra})]


@pytest.mark.parametrize("extra", [
    {"logit_bias": {"97": 1.0}},                       # the fake vocabulary is 97 ids: 97 is out of it
    {"logit_bias": {"123456789": 1.0}},
    {"logit_bias": {"-1": 1.0}},
    {"logit_bias": {"abc": 1.0}},
    {"logit_bias": {"5": 100.5}},
    {"max_tokens": 10_000},                            # does not fit max_model_len=256
    {"stop": [""]},
], ids=lambda e: json.dumps(e))
def test_3_streaming_request_is_validated_before_the_stream_starts(fake_server, extra):
    """Every check runs before the 200: a bad streaming request is a 400 JSON answer, never an event stream
    that carries the error; nothing reaches the engine."""
    h = fake_server
    for path, body in _stream_bodies(extra):
        with httpx.stream("POST", h.url + path, json=body, timeout=30) as r:
            r.read()
            assert_error(r, 400, "BadRequestError")
    assert wait_blocks_free(h.engine) and not h.engine.reqs
    for path, body in _stream_bodies({}):  # the same requests without the bad field stream fine
        r = httpx.post(h.url + path, json=body, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert sse_lines(r.text)[-1] == "[DONE]" and not any('"error"' in line for line in sse_lines(r.text))


# ------------------------------------------------------------------------------------------------ 4
@pytest.fixture(scope="module")
def capped_server():
    h = ServerHandle(FakeEngine(max_model_len=64, step_time=0.001), app_kwargs={"max_request_bytes": 64 * 1024})
    yield h
    h.stop()


def _read_status_line(sock: socket.socket, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_4_declared_oversized_body_is_refused_unread(capped_server):
    """Content-Length over the cap: 413 at once, while the client has sent headers and a few bytes of a
    50 MB body (the server never waits for the rest)."""
    with socket.create_connection(("127.0.0.1", capped_server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 50000000\r\n\r\n{\"prompt\": \"")
        head = _read_status_line(s)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"application/json" in head
    good(capped_server)


def test_4_undeclared_oversized_body_is_cut_while_read(capped_server):
    """A chunked body (no Content-Length) is counted as it arrives: the 413 comes back long before the
    client has sent 32 MB, i.e. the server stopped reading."""
    sent = 0
    with socket.create_connection(("127.0.0.1", capped_server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        s.settimeout(0.05)
        head = b""
        chunk = b"10000\r\n" + b"a" * 0x10000 + b"\r\n"
        while sent < 32 * 1024 * 1024 and b"\r\n\r\n" not in head:
            try:
                s.sendall(chunk)
                sent += 0x10000
            except OSError:
                break  # the server closed the connection after answering
            try:
                head += s.recv(4096)
            except socket.timeout:
                pass
        if b"\r\n\r\n" not in head:
            head += _read_status_line(s)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert sent < 32 * 1024 * 1024
    good(capped_server)


def test_4_body_cap_with_an_ordinary_client(capped_server):
    h = capped_server
    err = assert_error(httpx.post(h.url + COMPLETIONS, json={"prompt": "x" * 70_000}, timeout=30), 413,
                       "RequestTooLargeError")
    assert str(64 * 1024) in err["message"]
    r = httpx.post(h.url + COMPLETIONS, json={"prompt": "x" * 400, "max_tokens": 2}, timeout=30)  # under both caps
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]  # too many tokens, not 413


def test_4_prompt_length_checked_before_tokenizing(monkeypatch):
    """A prompt over 8 characters per token of max_model_len is refused before the tokenizer sees it, on
    every route that sends it to the engine; one at the limit is tokenized (and then refused for its token
    count). /tokenize only tokenizes: its cap is the larger input_checks.max_tokenize_chars."""
    from pagellm.entrypoints.openai.input_checks import max_tokenize_chars

    eng = FakeEngine(max_model_len=64)
    h = ServerHandle(eng)
    encoded: list[int] = []
    encode = eng.tokenizer.encode
    monkeypatch.setattr(eng.tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or encode(text, **kw))
    try:
        limit = 8 * 64
        over = "y" * (limit + 1)
        for path, body in [(COMPLETIONS, {"prompt": over}), (COMPLETIONS, {"prompt": ["ok", over]}),
                           (COMPLETIONS, {"prompt": over, "stream": True}),
                           (CHAT, {"messages": [{"role": "user", "content": over}]}),
                           (CHAT, {"messages": [{"role": "user", "content": "y" * 300},
                                                {"role": "user", "content": "y" * 300}]}),
                           ("/tokenize", {"prompt": "y" * (max_tokenize_chars(64) + 1)}),
                           ("/tokenize", {"messages": [{"role": "user", "content": "y" * max_tokenize_chars(64)},
                                                       {"role": "user", "content": "y"}]})]:
            err = assert_error(httpx.post(h.url + path, json=body, timeout=30), 400)
            assert err["code"] == "context_length_exceeded" and "characters" in err["message"], (path, err)
        assert all(n <= limit for n in encoded), encoded
        for body in ({"prompt": over}, {"messages": [{"role": "user", "content": over}]}):
            r = httpx.post(h.url + "/tokenize", json=body, timeout=30)
            assert r.status_code == 200 and r.json()["count"] >= len(over), r.text  # one id per character
            assert encoded[-1] >= len(over)  # tokenized, though no completion could take it
        encoded.clear()
        r = httpx.post(h.url + COMPLETIONS, json={"prompt": "y" * limit}, timeout=30)
        assert r.status_code == 400 and "characters" not in r.json()["error"]["message"]
        assert encoded[-1] == limit  # this one was tokenized: the token count refused it
    finally:
        h.stop()


# ------------------------------------------------------------------------------------------------ 5
HUGE = "Z" * 200_000


@pytest.mark.parametrize("path,body,status", [
    (COMPLETIONS, {"prompt": "x", "model": HUGE}, 404),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {HUGE: 1}}, 400),
    (COMPLETIONS, {"prompt": HUGE}, 400),
    (COMPLETIONS, {"prompt": [1, 2, HUGE]}, 400),
    (COMPLETIONS, {"prompt": "x", "temperature": HUGE}, 400),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": HUGE, "text": "x"}]}]}, 400),
    (CHAT, {"messages": [{"role": HUGE, "content": 5}]}, 400),
    ("/tokenize", {"prompt": HUGE * 6}, 400),  # over /tokenize's own cap (input_checks.TOKENIZE_MAX_CHARS)
    ("/detokenize", {"tokens": [1, 2, HUGE]}, 400),
], ids=range(9))
def test_5_error_bodies_quote_a_short_prefix_at_most(fake_server, path, body, status):
    """An error answer stays small whatever the input: it quotes at most a short prefix of it."""
    r = httpx.post(fake_server.url + path, json=body, timeout=30)
    err = assert_error(r, status)
    assert len(r.content) < 1000, (len(r.content), r.text[:300])
    assert "Z" * 100 not in r.text and len(err["param"] or "") < 100


# ------------------------------------------------------------------------------------------------ 6
def _route_calls(app) -> list[tuple[str, str]]:
    calls = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            calls.append((method, route.path))
    return calls


@pytest.mark.parametrize("metrics_require_auth", [False, True])
def test_6_every_route_needs_the_key_but_health_and_metrics(metrics_require_auth):
    """Enumerates the app's own routes (so a route added later is covered without touching this test):
    without the key each is a 401 except /health and /metrics (unless --metrics-require-auth); with the
    key none is."""
    h = ServerHandle(FakeEngine(), api_key="s3cret", app_kwargs={"metrics_require_auth": metrics_require_auth})
    open_paths = {"/health"} | (set() if metrics_require_auth else {"/metrics"})
    try:
        calls = _route_calls(h.app)
        assert {("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/openapi.json"), ("GET", "/docs"),
                ("POST", COMPLETIONS), ("GET", "/metrics")} <= set(calls)
        for method, path in calls:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = httpx.request(method, h.url + path, headers=headers, json={} if method == "POST" else None)
                if path in open_paths:
                    assert r.status_code != 401, (method, path)
                else:
                    assert r.status_code == 401, (method, path, headers, r.status_code)
                    if method != "HEAD":
                        assert r.json()["error"]["type"] == "AuthenticationError"
            r = httpx.request(method, h.url + path, headers={"Authorization": "Bearer s3cret"},
                              json={} if method == "POST" else None)
            assert r.status_code != 401, (method, path)
        assert httpx.get(h.url + "/no/such/route").status_code == 401  # no probing for routes either
        r = httpx.post(h.url + "/tokenize", json={"prompt": "abc"}, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["count"] == 3
    finally:
        h.stop()


# ------------------------------------------------------------------------------------------------ 8
def test_8_openapi_documents_400_and_never_422(fake_server):
    schema = httpx.get(fake_server.url + "/openapi.json").json()
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    error_ref = "#/components/schemas/ErrorResponse"
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if method == "post":
                for code in ("400", "401", "413", "503"):
                    assert op["responses"][code]["content"]["application/json"]["schema"]["$ref"] == error_ref, \
                        (path, code)
    for path in (COMPLETIONS, CHAT):
        assert "text/event-stream" in schema["paths"][path]["post"]["responses"]["200"]["content"]


def test_8_health_has_a_body_and_405_has_allow(fake_server):
    h = fake_server
    r = httpx.get(h.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = httpx.get(h.url + COMPLETIONS)
    err = assert_error(r, 405, "MethodNotAllowedError")
    assert r.headers["allow"] == "POST", (r.headers, err)
    r = httpx.post(h.url + "/v1/models", json={})
    assert_error(r, 405)
    assert r.headers["allow"] == "GET"


class _CrashingEngine(FakeEngine):
    """A fake engine whose step raises once `crash` is set: an engine that cannot go on."""

    crash = False

    def step(self):
        if self.crash:
            raise RuntimeError("simulated device failure")
        return super().step()


@pytest.mark.parametrize("how", ["crash", "shutdown"])
def test_8_health_is_503_with_a_body_when_the_engine_is_gone(how):
    eng = _CrashingEngine()
    h = ServerHandle(eng)
    try:
        good(h)
        if how == "crash":
            eng.crash = True
            r = httpx.post(h.url + COMPLETIONS, json={"prompt": "x", "max_tokens": 3}, timeout=30)
            assert_error(r, 503, "ServiceUnavailableError")  # the request in the failing step is told
        else:
            h.llm.shutdown()  # the engine loop stops: as good as dead for clients
        r = httpx.get(h.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "dead" and r.json()["message"], r.text
        assert_error(httpx.post(h.url + COMPLETIONS, json={"prompt": "x"}), 503, "ServiceUnavailableError")
    finally:
        h.stop()


# ------------------------------------------------------------------------------------------------ 9
def _collect(kind: str, url: str, body: dict, out: dict, key: str) -> None:
    try:
        if kind == "stream":
            with httpx.stream("POST", url, json=body, timeout=60) as r:
                out[key] = (r.status_code, dict(r.headers), [line for line in r.iter_lines() if line])
        else:
            r = httpx.post(url, json=body, timeout=60)
            out[key] = (r.status_code, dict(r.headers), r.json())
    except httpx.HTTPError as e:  # pragma: no cover - reported by the assertions below
        out[key] = e


def test_9_sigterm_drains_finishes_what_it_can_then_ends_streams_with_an_error_event():
    """On SIGTERM: new requests get 503 + Retry-After and /health says draining; a request that can finish
    within --shutdown-timeout does; at the deadline each open stream gets a final error event and [DONE],
    an unanswered request a 503; every KV block is free and the server stops."""
    eng = FakeEngine(max_model_len=512, max_num_seqs=8, step_time=0.02)
    h = ServerHandle(eng, shutdown_timeout_s=1.5)
    long_ = {"max_tokens": 400, "ignore_eos": True}
    jobs = {"stream": ("stream", COMPLETIONS, {"prompt": "a", "stream": True, **long_}),
            "chat_stream": ("stream", CHAT, {"messages": [{"role": "user", "content": "b"}], "stream": True, **long_}),
            "long": ("json", COMPLETIONS, {"prompt": "c", **long_}),
            "short": ("json", COMPLETIONS, {"prompt": "d", "max_tokens": 20})}
    out: dict = {}
    threads = [threading.Thread(target=_collect, args=(kind, h.url + path, body, out, key))
               for key, (kind, path, body) in jobs.items()]
    try:
        for t in threads:
            t.start()
        deadline = time.time() + 20
        while eng.get_num_unfinished_requests() < 4 and time.time() < deadline:
            time.sleep(0.01)
        h.sigterm()
        while httpx.get(h.url + "/health").status_code == 200:
            time.sleep(0.01)
        r = httpx.get(h.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "draining" and r.headers["retry-after"]
        r = httpx.post(h.url + COMPLETIONS, json={"prompt": "late"})
        assert_error(r, 503, "ServiceUnavailableError")
        assert int(r.headers["retry-after"]) > 0
        for t in threads:
            t.join(30)
        h.thread.join(15)
        assert not h.thread.is_alive(), "the server did not stop after the drain"
    finally:
        h.stop()
    status, _, body = out["short"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    status, headers, body = out["long"]
    assert status == 503 and body["error"]["code"] == "shutting_down" and int(headers["retry-after"]) > 0
    for key in ("stream", "chat_stream"):
        status, _, lines = out[key]
        events = [line[len("data: "):] for line in lines]
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        final = json.loads(events[-2])
        assert final["error"]["type"] == "ServiceUnavailableError" and final["error"]["code"] == "shutting_down"
        assert len(events) > 3  # it streamed tokens before it was ended
    report = h.server.drain_report
    assert report.num_cut == 3 and report.num_finished == 1, report
    assert eng.num_free_blocks == eng.num_total_blocks and not eng.has_unfinished_requests()


def test_9_idle_server_stops_at_once_on_sigterm():
    h = ServerHandle(FakeEngine(), shutdown_timeout_s=30)
    try:
        good(h)
        t0 = time.time()
        h.sigterm()
        h.thread.join(15)
        assert not h.thread.is_alive() and h.server.drain_report.num_cut == 0
        assert time.time() - t0 < 10  # nothing in flight: no waiting for the 30 s timeout
    finally:
        h.stop()
