#!/usr/bin/env python3
"""Soak test of `pagellm serve`: many concurrent clients send a random mix of valid requests, invalid ones
and requests they abandon midway, for N minutes, against a real server of the default model (started here
as a subprocess). It reports what was served, every outcome class per request kind (flagging any outcome
that kind must never get: a 5xx, a 200 for an invalid request, a dropped connection), the p50/p99 latency
of the valid requests, the server's RSS at start and end, and the KV blocks still in use at the end (read
from /metrics once the server is idle; anything but 0 is a leak).

    python benchmarks/bench_soak.py --minutes 1 --clients 4
    python benchmarks/bench_soak.py --minutes 30 --clients 32 --server-arg=--max-num-seqs --server-arg=16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import httpx
import psutil

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes of liquor and jugs "
         "under an amber sky near the river bank where old stories are told again").split()


@dataclass(frozen=True)
class Kind:
    name: str
    weight: float
    expected: frozenset  # outcomes this kind may get ("200", "400", "disconnected", ...)


KINDS = [
    Kind("completion", 3, frozenset({"200"})),
    Kind("completion_stream", 3, frozenset({"200"})),
    Kind("chat", 2, frozenset({"200"})),
    Kind("chat_stream", 2, frozenset({"200"})),
    Kind("stream_abandoned", 2, frozenset({"disconnected"})),     # reads a few events, then hangs up
    Kind("request_abandoned", 1, frozenset({"disconnected"})),    # gives up before the answer
    Kind("bad_json", 1, frozenset({"400"})),
    Kind("lone_surrogate", 1, frozenset({"400"})),
    Kind("bad_type", 1, frozenset({"400"})),
    Kind("prompt_too_many_chars", 1, frozenset({"400"})),
    Kind("prompt_too_many_tokens", 1, frozenset({"400"})),
    Kind("stream_bad_logit_bias", 1, frozenset({"400"})),
    Kind("unknown_model", 1, frozenset({"404"})),
    Kind("wrong_method", 1, frozenset({"405"})),
    Kind("body_too_large", 0.3, frozenset({"413", "closed_while_sending"})),
]
VALID = {"completion", "completion_stream", "chat", "chat_stream"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ------------------------------------------------------------------------------------------ one request
async def _post_json(c: httpx.AsyncClient, path: str, body: dict) -> str:
    return str((await c.post(path, json=body)).status_code)


async def _stream(c: httpx.AsyncClient, path: str, body: dict, hang_up_after: int | None = None) -> str:
    async with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return str(r.status_code)
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if hang_up_after is not None and len(events) >= hang_up_after:
                    return "disconnected"
        if not events or events[-1] != "[DONE]" or any('"error"' in e[:12] for e in events):
            return "stream_error"
        return "200"


async def send(kind: str, c: httpx.AsyncClient, rng: random.Random, max_model_len: int, model: str) -> str:
    prompt = words(rng, rng.randint(3, 120))
    gen = {"model": model, "max_tokens": rng.randint(1, 48), "temperature": rng.choice([0.0, 0.7, 1.0])}
    chat = {"messages": [{"role": "user", "content": prompt}], **gen}
    if kind == "completion":
        return await _post_json(c, "/v1/completions", {"prompt": prompt, **gen})
    if kind == "completion_stream":
        return await _stream(c, "/v1/completions", {"prompt": prompt, "stream": True, **gen})
    if kind == "chat":
        return await _post_json(c, "/v1/chat/completions", chat)
    if kind == "chat_stream":
        return await _stream(c, "/v1/chat/completions", {**chat, "stream": True})
    if kind == "stream_abandoned":
        body = {"prompt": prompt, "stream": True, **gen, "max_tokens": 200, "ignore_eos": True}
        return await _stream(c, "/v1/completions", body, hang_up_after=rng.randint(1, 6))
    if kind == "request_abandoned":
        try:
            await c.post("/v1/completions", json={"prompt": prompt, **gen, "max_tokens": 200, "ignore_eos": True},
                         timeout=rng.uniform(0.05, 0.5))
            return "200"  # it finished before the client gave up: still fine
        except httpx.TimeoutException:
            return "disconnected"
    return await _send_invalid(kind, c, rng, max_model_len, model, prompt)


async def _send_invalid(kind, c, rng, max_model_len, model, prompt) -> str:
    headers = {"content-type": "application/json"}
    if kind == "bad_json":
        return str((await c.post("/v1/completions", content=b'{"prompt": "x", ', headers=headers)).status_code)
    if kind == "lone_surrogate":
        raw = b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}'
        return str((await c.post("/v1/chat/completions", content=raw, headers=headers)).status_code)
    if kind == "bad_type":
        return await _post_json(c, "/v1/completions", {"prompt": prompt, "temperature": "hot"})
    if kind == "prompt_too_many_chars":
        return await _post_json(c, "/v1/completions", {"prompt": "x" * (8 * max_model_len + 1)})
    if kind == "prompt_too_many_tokens":
        # ~1.2 tokens per max_model_len but 7.2 characters per token: past the character check, refused for tokens
        return await _post_json(c, "/v1/completions", {"prompt": " ".join(["hello"] * int(1.2 * max_model_len))})
    if kind == "stream_bad_logit_bias":
        body = {"prompt": prompt, "stream": True, "logit_bias": {str(10**9 + rng.randint(0, 99)): 5}}
        return await _stream(c, "/v1/completions", body)
    if kind == "unknown_model":
        return await _post_json(c, "/v1/completions", {"prompt": prompt, "model": "no-such-model"})
    if kind == "wrong_method":
        return str((await c.get("/v1/chat/completions")).status_code)
    if kind == "body_too_large":
        try:
            r = await c.post("/v1/completions", content=b'{"prompt": "' + b"y" * (6 << 20) + b'"}', headers=headers)
            return str(r.status_code)
        except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
            return "closed_while_sending"  # it answered 413 and closed before the body was all sent
    raise ValueError(f"unknown kind {kind!r}")


# ------------------------------------------------------------------------------------------ the soak
async def client_loop(i: int, base_url: str, deadline: float, seed: int, max_model_len: int, model: str,
                      results: list) -> None:
    rng = random.Random(seed * 1000 + i)
    names, weights = [k.name for k in KINDS], [k.weight for k in KINDS]
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as c:
        while time.time() < deadline:
            kind = rng.choices(names, weights)[0]
            t0 = time.perf_counter()
            try:
                outcome = await send(kind, c, rng, max_model_len, model)
            except httpx.HTTPError as e:
                outcome = type(e).__name__
            results.append((kind, outcome, time.perf_counter() - t0))


def scrape_blocks_in_use(base_url: str) -> float | None:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    m = re.search(r"^pagellm:kv_cache_blocks_in_use\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def wait_idle_blocks(base_url: str, timeout_s: float = 15.0) -> float | None:
    """KV blocks in use once the server has settled (stats refresh when the engine loop idles)."""
    deadline = time.time() + timeout_s
    value = scrape_blocks_in_use(base_url)
    while value and time.time() < deadline:
        time.sleep(0.5)
        value = scrape_blocks_in_use(base_url)
    return value


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagellm.entrypoints.serve", "--port", str(port), *args.server_arg]
    with open(os.path.join(args.log_dir, "bench_soak_server.log"), "w") as log:  # the child keeps its own fd
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.startup_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log.name}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become healthy in time")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def report(results: list, seconds: float, rss: tuple[int, int], blocks: float | None, exit_code: int | None) -> bool:
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for kind, outcome, _ in results:
        by_kind[kind][outcome] += 1
    expected = {k.name: k.expected for k in KINDS}
    unexpected = {k: {o: n for o, n in c.items() if o not in expected[k]} for k, c in by_kind.items()}
    print(f"\n{'kind':<24}{'sent':>7}  outcomes")
    for k in (k.name for k in KINDS):
        c = by_kind.get(k, Counter())
        flags = "  UNEXPECTED: " + ", ".join(f"{o} x{n}" for o, n in unexpected.get(k, {}).items()) \
            if unexpected.get(k) else ""
        print(f"{k:<24}{sum(c.values()):>7}  " + ", ".join(f"{o} x{n}" for o, n in sorted(c.items())) + flags)
    lat = [dt for kind, outcome, dt in results if kind in VALID and outcome == "200"]
    served = sum(1 for _, outcome, _ in results if outcome in ("200", "disconnected"))
    print(f"\nrequests: {len(results)} in {seconds:.0f} s ({len(results) / seconds:.1f}/s); served {served}, "
          f"valid completed {len(lat)}")
    print(f"valid-request latency: p50 {percentile(lat, 0.5) * 1000:.0f} ms, p99 {percentile(lat, 0.99) * 1000:.0f} ms")
    print(f"server RSS: start {rss[0] / 2**20:.0f} MiB, end {rss[1] / 2**20:.0f} MiB "
          f"({(rss[1] - rss[0]) / 2**20:+.0f} MiB)")
    print(f"KV blocks in use at the end: {blocks}")
    print(f"server exit code after SIGTERM: {exit_code}")
    ok = not any(unexpected.values()) and blocks == 0 and exit_code == 0
    print("RESULT:", "PASS" if ok else "FAIL")
    return ok


async def soak(args, base_url: str, max_model_len: int, model: str) -> tuple[list, float]:
    results: list = []
    t0 = time.time()
    deadline = t0 + args.minutes * 60
    await asyncio.gather(*[client_loop(i, base_url, deadline, args.seed, max_model_len, model, results)
                           for i in range(args.clients)])
    return results, time.time() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[], help="extra `pagellm serve` argument (repeat)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "pagellm-soak"),
                   help="where the server log and the raw results go")
    args = p.parse_args(argv)
    os.makedirs(args.log_dir, exist_ok=True)
    proc, base_url = start_server(args)
    exit_code = None
    try:
        card = httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]
        server = psutil.Process(proc.pid)
        rss_start = server.memory_info().rss
        print(f"soaking {card['id']} (max_model_len={card['max_model_len']}) with {args.clients} clients for "
              f"{args.minutes:g} min at {base_url}", flush=True)
        results, seconds = asyncio.run(soak(args, base_url, int(card["max_model_len"]), card["id"]))
        blocks = wait_idle_blocks(base_url)
        rss_end = server.memory_info().rss
        proc.terminate()
        exit_code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with open(os.path.join(args.log_dir, "bench_soak_last.json"), "w") as f:
        json.dump({"results": results, "seconds": seconds, "rss": [rss_start, rss_end], "blocks": blocks,
                   "exit_code": exit_code}, f)
    return 0 if report(results, seconds, (rss_start, rss_end), blocks, exit_code) else 1


if __name__ == "__main__":
    sys.exit(main())
