#!/usr/bin/env python3
"""Online serving benchmark for any OpenAI-compatible server (pagellm, llama.cpp's server, vLLM).

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 \
        --request-rates 1,2,4,inf --goodput ttft:1000 tpot:100 --label pagellm
    pagellm bench serve ...            # the same

Arrivals: Poisson at --request-rate (inf = all at once), gamma with --burstiness (1 = Poisson,
< 1 burstier), optionally capped by --max-concurrency. Prompts: --dataset FILE.jsonl
({"prompt", "output_len"} per line) or the built-in mix over python3.11-doc. Streams through
/v1/completions and reports TTFT, TPOT, ITL, E2E (mean/p50/p90/p99), throughput and goodput;
writes one JSON per run to --result-dir and, for a sweep, a PNG of latency vs request rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from datetime import datetime

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving.client import stream_completion  # noqa: E402
from serving.datasets import MIXES, builtin_requests, fit_to_context, load_jsonl  # noqa: E402
from serving.metrics import format_summary, parse_goodput, summarize  # noqa: E402
from serving.plotting import plot_sweep  # noqa: E402


def _rate(s: str) -> float:
    return float("inf") if s.strip().lower() in ("inf", "infinity") else float(s)


def add_bench_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="model name sent in requests (default: the server's first)")
    p.add_argument("--label", default="server", help="name of this server in results and plots")
    p.add_argument("--api-key", default=os.environ.get("PAGELLM_API_KEY"))
    p.add_argument("--dataset", default="builtin", help="'builtin' or a JSONL file with prompt/output_len")
    p.add_argument("--builtin-mix", default="mixed", choices=sorted(MIXES),
                   help="class shares of the built-in prompts: mixed (45%% questions, 35%% passage + question, "
                        "20%% long summaries), or one class alone: chat, rag, summarize")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--output-len", type=int, default=None, help="override every request's output length")
    p.add_argument("--max-model-len", type=int, default=None, help="shrink/drop requests to fit this context")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir to count prompt tokens (else ~chars/4)")
    p.add_argument("--request-rate", type=_rate, default=float("inf"), help="req/s, Poisson (inf: all at once)")
    p.add_argument("--request-rates", default=None, help="comma list for a sweep, e.g. 1,2,4,inf")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs in ms: ttft:1000 tpot:100 e2el:20000")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let the model stop at EOS (default: ignore_eos so output lengths match)")
    p.add_argument("--warmup", type=int, default=2,
                   help="requests sent (sequentially) before each rate; their prompts are not among the measured ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", default="benchmarks/results")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    return p


async def _arrivals(n: int, rate: float, burstiness: float, rng: random.Random):
    for i in range(n):
        yield i
        if rate == float("inf") or i == n - 1:
            continue
        # gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate; burstiness 1 = exponential
        await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


async def _resolve_model(session, base_url, api_key):
    import aiohttp

    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with session.get(base_url + "/v1/models", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=10)) as r:
            data = await r.json()
            return data["data"][0]["id"]
    except Exception:  # noqa: BLE001 - some servers ignore the model field anyway
        return None


async def run_once(args, reqs, rate: float, warm=()) -> dict:
    import aiohttp

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    async with aiohttp.ClientSession(connector=conn) as session:
        model = args.model or await _resolve_model(session, base_url, args.api_key)
        for r in warm:
            await stream_completion(session, base_url, model, r.prompt, min(r.output_len, 16), 0, args.ignore_eos,
                                    args.api_key, args.timeout)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed)

        async def send(r):
            res = await stream_completion(session, base_url, model, r.prompt, r.output_len, r.prompt_len or 0,
                                          args.ignore_eos, args.api_key, args.timeout)
            res.kind = r.kind
            return res

        async def one(r):
            if sem is None:
                return await send(r)
            async with sem:
                return await send(r)

        ticks0 = cpu_times()
        t0 = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(reqs), rate, args.burstiness, rng):
            tasks.append(asyncio.create_task(one(reqs[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        steal = steal_fraction(ticks0, cpu_times())
    s = summarize(results, duration, parse_goodput(args.goodput))
    s.update(label=args.label, request_rate="inf" if rate == float("inf") else rate, burstiness=args.burstiness,
             max_concurrency=args.max_concurrency, num_prompts=len(reqs), model=model, base_url=base_url,
             dataset=dataset_name(args), cpu_steal=steal, date=datetime.now().isoformat(timespec="seconds"))
    return s


def cpu_times() -> list[int] | None:
    """The machine's aggregate CPU tick counters (/proc/stat `cpu` line), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def steal_fraction(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of CPU time the hypervisor took from this (virtual) machine between two readings: on a shared
    host this is what makes one run slower than another with the same code, so every result records it."""
    if not before or not after or len(before) < 8:
        return None
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return delta[7] / total if total > 0 else None


def dataset_name(args) -> str:
    return f"builtin:{args.builtin_mix}" if args.dataset == "builtin" else args.dataset


def build_requests(args, num: int | None = None, seed: int | None = None):
    """num requests (default --num-prompts): the built-in mix drawn with `seed` (default --seed), or a JSONL
    dataset's requests, shuffled with `seed` when one is given."""
    seed = args.seed if seed is None else seed
    num = args.num_prompts if num is None else num
    tok = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    if args.dataset == "builtin":
        reqs = builtin_requests(num, seed, tok, args.builtin_mix)
    else:
        reqs = load_jsonl(args.dataset)
        if seed != args.seed:
            random.Random(seed).shuffle(reqs)
        reqs = reqs[:num]
        for r in reqs:
            r.prompt_len = len(tok.encode(r.prompt)) if tok else None
    if args.output_len:
        for r in reqs:
            r.output_len = args.output_len
    return fit_to_context(reqs, args.max_model_len)


def rate_seed(seed: int, rate: float) -> int:
    """The seed a rate draws its requests with: derived from the rate itself, so a rate gets the same requests
    whatever else the sweep contains, and every server gets the same requests at the same rate."""
    return seed + (10**7 if rate == float("inf") else round(rate * 1000))


WARMUP_SEED_OFFSET = 10**8  # warm-up requests come from their own seed, never a measured rate's


def main(args) -> list[dict]:
    rates = [_rate(x) for x in args.request_rates.split(",")] if args.request_rates else [args.request_rate]
    # Fresh requests per rate: re-sending one rate's prompts at the next would let a prefix cache skip their
    # prefill (pagellm's did: the first sweeps measured cached prompts at every rate after the first).
    warm = build_requests(args, args.warmup, args.seed + WARMUP_SEED_OFFSET) if args.warmup else []
    per_rate = [build_requests(args, args.num_prompts, rate_seed(args.seed, r)) for r in rates]
    runs = []
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    if not args.no_save:
        os.makedirs(args.result_dir, exist_ok=True)
    for rate, reqs in zip(rates, per_rate):
        s = asyncio.run(run_once(args, reqs, rate, warm))
        print(format_summary(s, f"{args.label} @ {s['request_rate']} req/s"), flush=True)
        runs.append(s)
        if not args.no_save:
            path = os.path.join(args.result_dir, f"{args.label}-rate{s['request_rate']}-{stamp}.json")
            with open(path, "w") as f:
                json.dump(s, f, indent=2)
            print(f"wrote {path}")
    if len(runs) > 1 and not args.no_save:
        png = plot_sweep(runs, os.path.join(args.result_dir, f"{args.label}-sweep-{stamp}.png"),
                         f"{args.label}: latency vs request rate")
        print(f"wrote {png}")
    return runs


def compare_main(argv=None) -> None:
    """python bench_serving.py --compare a.json b.json ... --plot out.png: one plot of several servers."""
    p = argparse.ArgumentParser()
    p.add_argument("--compare", nargs="+", required=True)
    p.add_argument("--plot", required=True)
    a = p.parse_args(argv)
    runs = [json.load(open(f)) for f in a.compare]
    plot_sweep(runs, a.plot, "latency vs request rate")
    print(f"wrote {a.plot}")


if __name__ == "__main__":
    if "--compare" in sys.argv:
        compare_main(sys.argv[1:])
    else:
        main(add_bench_args(argparse.ArgumentParser(description=__doc__,
                                                    formatter_class=argparse.RawDescriptionHelpFormatter))
             .parse_args())
