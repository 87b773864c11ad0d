"""Streaming OpenAI-completions client (aiohttp) that records per-request timings.

Works against any OpenAI-compatible server (pagellm, llama.cpp's llama_cpp.server, vLLM): every
SSE chunk with new text counts as one token for inter-token latency; the output token count is the
server's `usage.completion_tokens` when it sends usage, else the number of text chunks.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len_requested: int = 0
    output_tokens: int = 0
    ttft: float = 0.0                 # seconds
    latency: float = 0.0              # seconds, end to end
    itl: list[float] = field(default_factory=list)   # seconds between successive text chunks
    start_time: float = 0.0
    error: str = ""
    status: int = 0
    kind: str = ""                    # the request's class in the dataset (question, rag, summarize, ...)


async def stream_completion(session: aiohttp.ClientSession, base_url: str, model: str | None, prompt: str,
                            max_tokens: int, prompt_len: int = 0, ignore_eos: bool = True,
                            api_key: str | None = None, timeout_s: float = 600.0) -> RequestResult:
    res = RequestResult(prompt_len=prompt_len, output_len_requested=max_tokens)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    st = time.perf_counter()
    res.start_time = time.time()
    last = st
    chunks = 0
    usage_tokens = None
    try:
        async with session.post(base_url.rstrip("/") + "/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            async for piece in resp.content.iter_any():
                buf += piece
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        obj = json.loads(data)
                        if "error" in obj:
                            res.error = str(obj["error"])[:200]
                            return res
                        if obj.get("usage"):
                            usage_tokens = obj["usage"].get("completion_tokens")
                        choices = obj.get("choices") or []
                        if choices and choices[0].get("text"):
                            now = time.perf_counter()
                            if chunks == 0:
                                res.ttft = now - st
                            else:
                                res.itl.append(now - last)
                            last = now
                            chunks += 1
        res.latency = time.perf_counter() - st
        res.output_tokens = usage_tokens if usage_tokens else chunks
        res.success = chunks > 0
        if not res.success:
            res.error = "no tokens received"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res
