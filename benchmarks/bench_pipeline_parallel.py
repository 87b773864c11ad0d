"""Offline throughput of pipeline parallelism on a random Llama: PP=1 (one process, every CPU) vs PP=2 taking
turns (pipeline_microbatching=False: one step at a time, each stage idle while the other runs) vs PP=2 with
micro-batches (two steps in flight over disjoint halves of the requests).

    python benchmarks/bench_pipeline_parallel.py                 # ~0.25B random Llama (bf16), 16 x (64 + 32)
    python benchmarks/bench_pipeline_parallel.py --tiny --requests 8 --new-tokens 8    # smoke run (seconds)
    python benchmarks/bench_pipeline_parallel.py --rounds 3     # rows of each round interleaved

PP=2 ranks pin themselves to one half of the allowed CPUs each (pagellm.engine.mp_worker); PP=1 gets all of
them (PAGELLM_NUM_THREADS = the CPU count). The three engines are built once and stay up; each round runs the
same greedy workload on each in turn (the first, untimed, run warms them). Throughput counts generated tokens
over the wall time from the first add_request to the last output, in the driver. On a shared machine that
number moves with the load, so the PP=2 rows also report how the stages overlapped, from each rank's own
compute intervals (a step from its start, or from when the previous stage's activations arrived, to its end,
or to when it starts sending them on; CLOCK_MONOTONIC, one clock for every process): busy = the share of the
wall time a stage computed, both = the share during which both stages did (about 0 when they take turns).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SMALL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
CONFIGS = (("PP=1", 1, True), ("PP=2 one step at a time", 2, False), ("PP=2 micro-batches", 2, True))


def write_random_llama(path: Path, shape: dict, dtype: torch.dtype) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(cfg).to(dtype).save_pretrained(str(path))
    return path


def _record_step_intervals(worker) -> None:
    """On every rank: keep each step's compute interval (monotonic), without the waits for activations."""
    import pagellm.models.llama as llama  # the random model is a Llama: its forward receives / sends

    if getattr(worker, "bench_intervals", None) is not None:
        return
    worker.bench_intervals, marks = [], {}
    execute, recv, send = worker.runner.execute, llama.recv_activations, llama.send_activations

    def received(*args, **kwargs):
        out = recv(*args, **kwargs)
        marks["computing_from"] = time.monotonic()
        return out

    def sending(*args, **kwargs):
        marks["computing_to"] = time.monotonic()
        return send(*args, **kwargs)

    def timed(*args, **kwargs):
        marks.clear()
        t0 = time.monotonic()
        try:
            return execute(*args, **kwargs)
        finally:
            t1 = time.monotonic()
            worker.bench_intervals.append((marks.get("computing_from", t0), marks.get("computing_to", t1)))

    llama.recv_activations, llama.send_activations, worker.runner.execute = received, sending, timed


def _take_step_intervals(worker) -> list[tuple[float, float]]:
    taken, worker.bench_intervals = worker.bench_intervals, []
    return taken


def _busy(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds during which an interval of `a` and one of `b` both ran (each list in time order, disjoint)."""
    total, j = 0.0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            total += max(0.0, min(e, b[k][1]) - max(s, b[k][0]))
            k += 1
    return total


def stage_overlap(engine, secs: float) -> str:
    """'busy a% / b%, both c%' of the last run (PP=2), or '-' for one process."""
    if engine.config.parallel_config.pipeline_parallel_size == 1:
        return "-"
    first, last = engine.collective_rpc(_take_step_intervals)
    return (f"{100 * _busy(first) / secs:.0f}% / {100 * _busy(last) / secs:.0f}%, "
            f"both {100 * _overlap(first, last) / secs:.0f}%")


def build(model: str, pp: int, microbatching: bool, dtype: str, cpus: int):
    from pagellm.config import EngineArgs
    from pagellm.engine.llm_engine import LLMEngine

    if pp == 1:
        os.environ["PAGELLM_NUM_THREADS"] = str(cpus)  # one process: every CPU
    try:
        return LLMEngine.from_engine_args(EngineArgs(model=model, dtype=dtype, pipeline_parallel_size=pp,
                                                     pipeline_microbatching=microbatching, num_kv_blocks=256,
                                                     max_model_len=512, block_size=16))
    finally:
        os.environ.pop("PAGELLM_NUM_THREADS", None)


def run_workload(engine, num_requests: int, prompt_len: int, new_tokens: int, vocab: int) -> tuple[float, int]:
    """(seconds, generated tokens) of num_requests greedy requests, all added at once."""
    from pagellm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    for i in range(num_requests):  # distinct prompts: no prefix-cache hits between requests
        ids = [(i * 131 + 7 * j) % (vocab - 3) + 3 for j in range(prompt_len)]
        engine.add_request(f"req{i}", {"prompt_token_ids": ids}, params)
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
    engine.reset_prefix_cache()
    return time.perf_counter() - t0, generated


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny random model (smoke run)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="timed runs of each engine, interleaved")
    a = p.parse_args()
    if min(a.requests, a.prompt_len, a.new_tokens, a.rounds) < 1:
        print("--requests, --prompt-len, --new-tokens and --rounds must be >= 1", file=sys.stderr)
        return 2
    dtype = a.dtype or ("float32" if a.tiny else "bfloat16")
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        print("needs at least 2 allowed CPUs", file=sys.stderr)
        return 2
    shape = TINY if a.tiny else SMALL
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_random_llama(Path(tmp) / "llama", shape, getattr(torch, dtype)))
        engines = {name: build(model, pp, mb, dtype, cpus) for name, pp, mb in CONFIGS}
        try:
            for engine in engines.values():  # warm-up: first-call costs, thread pools, page faults
                run_workload(engine, a.requests, a.prompt_len, min(a.new_tokens, 4), shape["vocab_size"])
                if engine.config.parallel_config.pipeline_parallel_size > 1:
                    engine.collective_rpc(_record_step_intervals)
            print(f"offline throughput, random Llama {shape['hidden_size']}x{shape['num_hidden_layers']} layers, "
                  f"{dtype}, {a.requests} requests x ({a.prompt_len} prompt + {a.new_tokens} new) tokens, "
                  f"{cpus} CPUs, {a.rounds} rounds interleaved")
            print("| config | round | load (1 min) | wall s | generated tok/s | vs PP=1 | stages busy, both |")
            print("|---|---:|---:|---:|---:|---:|---|", flush=True)
            rates: dict[str, list[float]] = {name: [] for name in engines}
            for r in range(a.rounds):
                for name, engine in engines.items():
                    load = os.getloadavg()[0]
                    secs, generated = run_workload(engine, a.requests, a.prompt_len, a.new_tokens,
                                                   shape["vocab_size"])
                    rates[name].append(generated / secs)
                    ratio = rates[name][-1] / rates["PP=1"][-1]
                    print(f"| {name} | {r + 1} | {load:.1f} | {secs:.2f} | {rates[name][-1]:.1f} | {ratio:.2f}x | "
                          f"{stage_overlap(engine, secs)} |", flush=True)
            print("\nmedians:")
            for name, values in rates.items():
                med = statistics.median(values)
                print(f"  {name:26s} {med:8.1f} tok/s  {med / statistics.median(rates['PP=1']):.2f}x PP=1")
        finally:
            for engine in engines.values():
                engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
