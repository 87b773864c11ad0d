#!/usr/bin/env python3
"""How much does AsyncLLM's 3-stage pipeline gain over a naive serial loop?

Both variants serve the same N concurrent streaming clients, each client turning every output into
an OpenAI SSE chunk (text delta + top-5 logprobs, json.dumps) like the server does:

  serial:    one coroutine on the event loop: tokenize new prompts, engine.step(), then build and
             deliver every client's chunk, then the next step (the model waits for the Python work).
  pipelined: AsyncLLM: tokenization in a tokenizer thread, engine.step() in the engine thread,
             chunk building in the clients' coroutines on the event loop, overlapped with the next
             step (torch releases the GIL while it computes).

    python benchmarks/serving/bench_pipeline.py                      # fake engine, torch-matmul "model"
    python benchmarks/serving/bench_pipeline.py --engine real --model DIR_OR_GGUF

Reports wall time and output tokens/s of each, and the gain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
try:
    import pagellm  # noqa: F401  (installed, or on PYTHONPATH)
except ImportError:
    sys.path.insert(1, os.path.join(ROOT, "python"))

from pagellm.engine.async_llm import AsyncLLM  # noqa: E402
from pagellm.sampling_params import SamplingParams  # noqa: E402


def make_fake_engine(args):
    import torch

    from tests.server.fake_engine import FakeEngine

    class TorchFakeEngine(FakeEngine):
        """FakeEngine whose step does real (GIL-releasing) torch compute, scaled with the batch."""

        def __init__(self, **kw):
            super().__init__(**kw)
            torch.manual_seed(0)
            self.w = torch.randn(args.hidden, args.hidden)

        def step(self):
            self.step_time = 0
            bs = max(1, sum(len(r.seqs) for r in self.running) + len(self.waiting))
            x = torch.randn(bs, args.hidden)
            for _ in range(args.layers):
                x = torch.tanh(x @ self.w)
            return super().step()

    return TorchFakeEngine(max_model_len=8192, max_num_seqs=args.concurrency, num_blocks=1 << 20)


def make_real_engine(args):
    from pagellm.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(model=args.model, max_num_seqs=args.concurrency, max_model_len=2048,
                                      kv_cache_memory_gb=0.5)


def chunk_json(rid: str, delta: str, token_ids, k: int = 5) -> str:
    lps = [{"token": f"t{t}", "logprob": -0.1 * i, "top_logprobs": {f"t{t + j}": -0.1 * j for j in range(k)}}
           for i, t in enumerate(token_ids)]
    return "data: " + json.dumps({"id": rid, "object": "text_completion", "created": 0, "model": "m",
                                  "choices": [{"index": 0, "text": delta, "logprobs": lps,
                                               "finish_reason": None}]}) + "\n\n"


def prompts(args, tokenizer):
    base = ("Explain how Python's garbage collector deals with reference cycles, and when you would "
            "call gc.collect() explicitly in a long-running server. ")
    return [f"[{i}] " + base * args.prompt_repeat for i in range(args.num_requests)]


async def run_pipelined(engine, ps, args) -> tuple[float, int]:
    llm = AsyncLLM(engine)
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)

    chunks = [0]

    async def client(i, p):
        sent_text = sent_tok = 0
        async for out in llm.generate(p, sp, f"r{i}"):
            c = out.outputs[0]
            chunk_json(f"r{i}", c.text[sent_text:], c.token_ids[sent_tok:])
            chunks[0] += 1
            sent_text, sent_tok = len(c.text), len(c.token_ids)
        return sent_tok

    t0 = time.perf_counter()
    sem = asyncio.Semaphore(args.concurrency)

    async def bounded(i, p):
        async with sem:
            return await client(i, p)

    toks = await asyncio.gather(*[bounded(i, p) for i, p in enumerate(ps)])
    dt = time.perf_counter() - t0
    llm.shutdown()
    print(f"  pipelined: {chunks[0]} chunks built, {llm.num_steps} steps, "
          f"engine busy {llm.step_time_total / dt * 100:.0f}% of wall time")
    return dt, sum(toks)


async def run_serial(engine, ps, args) -> tuple[float, int]:
    from concurrent.futures import ThreadPoolExecutor

    tok = engine.get_tokenizer()
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(1)
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    queue = list(enumerate(ps))
    sent: dict[str, list[int]] = {}
    total = 0
    chunks = 0
    step_time = 0.0
    while queue or engine.has_unfinished_requests():
        while queue and engine.get_num_unfinished_requests() < args.concurrency:
            i, p = queue.pop(0)
            ids = tok.encode(p)
            engine.add_request(f"r{i}", {"prompt_token_ids": list(ids)}, sp)
            sent[f"r{i}"] = [0, 0]
        ts = time.perf_counter()
        # step in a worker thread too (torch on the main thread can be much slower, see README),
        # but the loop waits for it: no overlap
        outs = await loop.run_in_executor(pool, engine.step)
        step_time += time.perf_counter() - ts
        for out in outs:
            chunks += 1
            c = out.outputs[0]
            st = sent[out.request_id]
            chunk_json(out.request_id, c.text[st[0]:], c.token_ids[st[1]:])
            st[0], st[1] = len(c.text), len(c.token_ids)
            if out.finished:
                total += st[1]
        await asyncio.sleep(0)
    dt = time.perf_counter() - t0
    print(f"  serial:    {chunks} chunks built, engine busy {step_time / dt * 100:.0f}% of wall time")
    return dt, total


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["fake", "real"], default="fake")
    p.add_argument("--model", default=None)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-repeat", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024, help="fake model width")
    p.add_argument("--layers", type=int, default=4, help="fake model depth")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    make = make_fake_engine if args.engine == "fake" else make_real_engine
    results = {"serial": [], "pipelined": []}
    warm = make(args)  # warm-up (torch init, allocator)
    asyncio.run(run_serial(warm, prompts(args, warm.get_tokenizer())[:4], args))
    for _ in range(args.repeats):
        for name, fn in (("serial", run_serial), ("pipelined", run_pipelined)):
            eng = make(args)
            ps = prompts(args, eng.get_tokenizer())
            dt, toks = asyncio.run(fn(eng, ps, args))
            results[name].append((dt, toks))
            print(f"{name:10s} {dt:7.3f} s  {toks} tokens  {toks / dt:8.1f} tok/s", flush=True)
    best = {k: min(v) for k, v in results.items()}
    gain = best["serial"][0] / best["pipelined"][0]
    print(f"best-of-{args.repeats}: serial {best['serial'][0]:.3f} s, pipelined {best['pipelined'][0]:.3f} s "
          f"-> pipelined is {gain:.2f}x ({(gain - 1) * 100:+.1f}% throughput)")


if __name__ == "__main__":
    main()
