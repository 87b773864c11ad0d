"""The OpenAI-compatible server against the deterministic fake engine: protocol shapes, streaming,
errors (each followed by a good request), auth, overload (429), disconnects freeing blocks."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from .conftest import ServerHandle, wait_blocks_free
from .fake_engine import FakeEngine

openai = pytest.importorskip("openai")


def client(h, **kw):
    return openai.OpenAI(base_url=h.url + "/v1", api_key=kw.pop("api_key", "x"), max_retries=0, timeout=30, **kw)


def good(h):
    r = httpx.post(h.url + "/v1/completions", json={"model": h.model, "prompt": "Hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def sse_events(text: str) -> list:
    evs = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert evs[-1] == "[DONE]"
    return [json.loads(e) for e in evs[:-1]]


def test_models_health_metrics(fake_server):
    h = fake_server
    c = client(h)
    assert [m.id for m in c.models.list().data] == [h.model]
    assert httpx.get(h.url + "/health").status_code == 200
    good(h)
    m = httpx.get(h.url + "/metrics").text
    for name in ("pagellm:time_to_first_token_seconds", "pagellm:inter_token_latency_seconds",
                 "pagellm:e2e_request_latency_seconds", "pagellm:request_queue_time_seconds",
                 "pagellm:prompt_tokens_total", "pagellm:generation_tokens_total",
                 "pagellm:num_requests_running", "pagellm:num_requests_waiting",
                 "pagellm:kv_cache_usage_perc", "pagellm:prefix_cache_hit_rate"):
        assert name in m, name


def test_completion_basic_and_n(fake_server):
    c = client(fake_server)
    r = c.completions.create(model=fake_server.model, prompt="Hello", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].text) == 5
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 5
    r = c.completions.create(model=fake_server.model, prompt=["ab", "cde"], max_tokens=4, n=2, seed=1)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 16
    r = c.completions.create(model=fake_server.model, prompt=[[5, 6, 7], [8, 9]], max_tokens=2)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 5
    r = c.completions.create(model=fake_server.model, prompt=[5, 6, 7], max_tokens=2)
    assert len(r.choices) == 1 and r.usage.prompt_tokens == 3


def test_completion_stream(fake_server):
    c = client(fake_server)
    chunks = list(c.completions.create(model=fake_server.model, prompt="Hello", max_tokens=6, stream=True,
                                       n=2, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finish = {}
    for ch in chunks[:-1]:
        for choice in ch.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert len(texts[0]) == 6 and len(texts[1]) == 6 and finish == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    full = c.completions.create(model=fake_server.model, prompt="Hello", max_tokens=6, n=2)
    assert {ch.index: ch.text for ch in full.choices} == texts
    raw = httpx.post(fake_server.url + "/v1/completions",
                     json={"prompt": "Hello", "max_tokens": 3, "stream": True}, timeout=30)
    assert raw.text.rstrip().endswith("data: [DONE]")
    assert len(sse_events(raw.text)) >= 3


def test_stop_and_logprobs(fake_server):
    c = client(fake_server)
    base = c.completions.create(model=fake_server.model, prompt="Hello", max_tokens=8, temperature=0).choices[0].text
    stop = base[3:5]
    r = c.completions.create(model=fake_server.model, prompt="Hello", max_tokens=8, stop=[stop], temperature=0)
    assert r.choices[0].text == base[: base.index(stop)] and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model=fake_server.model, prompt="Hello", max_tokens=4, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(len(t) >= 3 for t in lp.top_logprobs)
    assert lp.text_offset == [0, 1, 2, 3]


def test_echo_prompt_logprobs(fake_server):
    c = client(fake_server)
    r = c.completions.create(model=fake_server.model, prompt="Hello", max_tokens=0, echo=True, logprobs=1)
    ch = r.choices[0]
    assert ch.text == "Hello" and r.usage.completion_tokens == 0
    assert ch.logprobs.tokens == list("Hello")
    assert ch.logprobs.token_logprobs[0] is None and all(x is not None for x in ch.logprobs.token_logprobs[1:])
    r = c.completions.create(model=fake_server.model, prompt="Hello", max_tokens=2, echo=True, logprobs=1)
    assert r.choices[0].text.startswith("Hello") and len(r.choices[0].logprobs.tokens) == 7
    s = list(c.completions.create(model=fake_server.model, prompt="Hello", max_tokens=0, echo=True, logprobs=1,
                                  stream=True))
    assert "".join(x.choices[0].text for x in s) == "Hello"


def test_chat(fake_server):
    c = client(fake_server)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model=fake_server.model, messages=msgs, max_tokens=5, n=2, logprobs=True,
                                  top_logprobs=2, seed=3)
    assert len(r.choices) == 2 and r.choices[0].message.role == "assistant"
    assert len(r.choices[0].message.content) == 5
    assert len(r.choices[0].logprobs.content) == 5 and len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    r2 = c.chat.completions.create(model=fake_server.model, messages=msgs, max_completion_tokens=3)
    assert r2.usage.completion_tokens == 3
    chunks = list(c.chat.completions.create(model=fake_server.model, messages=msgs, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(text) == 5 and chunks[-1].usage.completion_tokens == 5
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    r = c.chat.completions.create(model=fake_server.model, messages=msgs, max_tokens=8, stop=[text[2:4]])
    assert r.choices[0].message.content == text[:2] and r.choices[0].finish_reason == "stop"


def test_tokenize_detokenize(fake_server):
    h = fake_server
    r = httpx.post(h.url + "/tokenize", json={"prompt": "abc"}).json()
    assert r["count"] == 3 and len(r["tokens"]) == 3
    assert httpx.post(h.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "abc"
    r = httpx.post(h.url + "/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert r["count"] > 3
    assert httpx.post(h.url + "/detokenize", json={"tokens": "abc"}).status_code == 400


BAD = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, 400),
    ("/v1/completions", {"prompt": "a", "temperature": 3.5}, 400),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400),
    ("/v1/completions", {"prompt": "a", "top_p": 1.5}, 400),
    ("/v1/completions", {"prompt": "a", "n": True}, 400),
    ("/v1/completions", {"prompt": {"x": 1}}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": "a" * 300}, 400),
    ("/v1/completions", {"prompt": "a" * 250, "max_tokens": 50}, 400),
    ("/v1/completions", {"prompt": "a", "model": "nope"}, 404),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": -1}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD)
def test_errors_then_good(fake_server, path, body, status):
    h = fake_server
    if isinstance(body, bytes):
        r = httpx.post(h.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(h.url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    good(h)


def test_openai_client_raises_bad_request(fake_server):
    c = client(fake_server)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=fake_server.model, prompt="a", temperature=5)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    good(fake_server)


def test_auth():
    h = ServerHandle(FakeEngine(), api_key="s3cret")
    try:
        assert httpx.get(h.url + "/v1/models").status_code == 401
        r = httpx.get(h.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert httpx.get(h.url + "/health").status_code == 200  # not under /v1
        with pytest.raises(openai.AuthenticationError):
            client(h, api_key="bad").models.list()
        assert client(h, api_key="s3cret").completions.create(model=h.model, prompt="x", max_tokens=2).choices
    finally:
        h.stop()


def test_overload_429():
    eng = FakeEngine(max_num_seqs=2, step_time=0.01)
    h = ServerHandle(eng, max_queue_len=2)

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*[c.post(h.url + "/v1/completions", json={"prompt": "x", "max_tokens": 20})
                                        for _ in range(12)])
            return [r.status_code for r in rs], [r.json() for r in rs]

    try:
        codes, bodies = asyncio.run(main())
        assert codes.count(200) >= 4 and codes.count(429) >= 1, codes
        assert set(codes) <= {200, 429}
        assert all(b["error"]["type"] == "RateLimitError" for code, b in zip(codes, bodies) if code == 429)
        good(h)
        assert wait_blocks_free(eng)
    finally:
        h.stop()


def test_disconnects_free_blocks():
    """64 concurrent streams, a third disconnect mid-stream: survivors complete, all blocks free."""
    eng = FakeEngine(max_num_seqs=32, num_blocks=4096, step_time=0.003)
    h = ServerHandle(eng)

    async def one(c, i, drop):
        body = {"prompt": f"request {i}", "max_tokens": 40, "stream": True}
        if i % 2:
            body = {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 40, "stream": True}
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        got = []
        async with c.stream("POST", h.url + path, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    got.append(line)
                    if drop and len(got) >= 5:
                        return "dropped"
        assert got[-1] == "data: [DONE]"
        return "done"

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as c:
            return await asyncio.gather(*[one(c, i, i % 3 == 0) for i in range(64)])

    try:
        res = asyncio.run(main())
        assert res.count("done") == 64 - len(range(0, 64, 3))
        assert wait_blocks_free(eng, 10), (eng.num_free_blocks, eng.num_total_blocks)
        good(h)
        assert wait_blocks_free(eng, 10)
    finally:
        h.stop()


def test_nonstream_disconnect_aborts():
    eng = FakeEngine(step_time=0.01)
    h = ServerHandle(eng)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(h.url + "/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True},
                       timeout=0.3)
        assert wait_blocks_free(eng, 5)
        assert eng.num_steps < 200
    finally:
        h.stop()
