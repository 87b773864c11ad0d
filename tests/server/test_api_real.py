"""The server in front of the real LLMEngine with a tiny random-weight Llama (tests/conftest.py):
official openai client and raw httpx, then 64 concurrent streams with a third disconnecting ->
every KV block free again and every surviving stream complete."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")
openai = pytest.importorskip("openai")

from .conftest import ServerHandle  # noqa: E402


@pytest.fixture(scope="module")
def real_server(tiny_llama_dir):
    from pagellm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(model=str(tiny_llama_dir), max_model_len=256, max_num_seqs=32,
                                        num_kv_blocks=1024, seed=0)
    baseline = engine.num_free_blocks
    h = ServerHandle(engine, model_name="tiny")
    h.baseline_free = baseline
    yield h
    h.stop()


def blocks_all_free(h, timeout=15.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not h.engine.has_unfinished_requests() and h.engine.num_free_blocks == h.baseline_free:
            return True
        time.sleep(0.05)
    return False


def cl(h):
    return openai.OpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_real_completions(real_server):
    h = real_server
    assert h.llm.max_model_len == 256 and h.llm.max_num_seqs == 32
    c = cl(h)
    r = c.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    again = c.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic
    chunks = list(c.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    r = c.completions.create(model="tiny", prompt=["Tell me", "about the sea"], max_tokens=4, n=2, seed=7,
                             logprobs=2, extra_body={"ignore_eos": True})
    assert len(r.choices) == 4 and all(len(ch.logprobs.tokens) == 4 for ch in r.choices)
    stop_text = r.choices[0].text
    r = c.completions.create(model="tiny", prompt="Hello world, naïve café", max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "Hello world, naïve café" and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert stop_text is not None


def test_real_chat_and_errors(real_server):
    h = real_server
    c = cl(h)
    msgs = [{"role": "user", "content": "Tell me about the sea"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, logprobs=True, top_logprobs=3,
                                  n=2, seed=1, extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and r.usage.completion_tokens == 12
    assert len(r.choices[0].logprobs.content) == 6
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=5, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 5
    for body, status in [({"prompt": "sea " * 400}, 400), ({"prompt": "a", "temperature": -1}, 400),
                         ({"prompt": "a", "max_tokens": "x"}, 400), ({"prompt": "a", "model": "nope"}, 404),
                         ({"prompt": [999999]}, 400)]:
        resp = httpx.post(h.url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code == status, (body, resp.text)
        assert resp.json()["error"]["message"]
        ok = httpx.post(h.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
    assert blocks_all_free(h)


def test_real_disconnects_free_blocks(real_server):
    h = real_server

    async def one(c, i, drop):
        if i % 2:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"question {i}"}]}
        else:
            path, body = "/v1/completions", {"prompt": f"Once upon a time {i}"}
        body.update(max_tokens=48, stream=True, ignore_eos=True)
        lines = []
        async with c.stream("POST", h.url + path, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if drop and len(lines) >= 4:
                        return "dropped"
        assert lines[-1] == "data: [DONE]", lines[-3:]
        return "done"

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as c:
            return await asyncio.gather(*[one(c, i, i % 3 == 0) for i in range(64)])

    res = asyncio.run(main())
    assert res.count("done") == 64 - 22 and res.count("dropped") == 22
    assert blocks_all_free(h), (h.engine.num_free_blocks, h.baseline_free)
    m = httpx.get(h.url + "/metrics").text
    assert "pagellm:time_to_first_token_seconds_count" in m
    st = h.llm.get_stats()
    assert st.num_total_blocks and st.num_free_blocks is not None and st.prefix_cache_queries > 0
