#!/usr/bin/env python
"""Batch-1 decode of the default model when another process keeps the CPUs busy: pagellm's thread pool
vs the previous threading (PAGELLM_THREAD_POOL=0: kernels on at::parallel_for, torch's OpenMP defaults).

    python benchmarks/bench_contention.py                 # 3 rounds, 32 new tokens per measurement
    python benchmarks/bench_contention.py --rounds 2 --output-len 16

One engine process per variant loads the model once and waits; the parent interleaves the measurements:
for each round and each condition (quiet; a Python spin loop; a numpy matmul loop, each a separate
process pinned nowhere), it starts the competitor, asks every variant for one request's TPOT (greedy,
ignore_eos), and stops the competitor. Prints median TPOT per (variant, condition) and the ratio to the
variant's quiet median. Noisy on a shared machine: the load average is printed before and after.
Writes benchmarks/results/contention_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {"at::parallel_for (old)": {"PAGELLM_THREAD_POOL": "0"}, "pagellm pool": {"PAGELLM_THREAD_POOL": "1"}}
COMPETITORS = {
    "quiet": None,
    "busy python spin": "while True: pass",
    "busy numpy matmul": ("import numpy as np\na = np.random.rand(512, 512)\nwhile True: a @ a"),
}

# The engine process: loads the model, then answers "<n_out>" lines on stdin with one JSON line of timings.
ENGINE_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import common as C
from bench_latency import stream_one
from pagellm import _C
tok, _ = C.load_tokenizer_for_prompts()
pool = C.doc_token_pool(tok, max_chars=50_000)
prompt_len, max_out = int(sys.argv[2]), int(sys.argv[3])
llm = C.make_llm("smollm2-135m", max_model_len=prompt_len + max_out + 16, max_num_seqs=1, kv_gb=0.25)
eng = llm.llm_engine
stream_one(eng, pool[:48], 12, "warm")
print(json.dumps({"ready": True}), flush=True)
for i, line in enumerate(sys.stdin):
    eng.reset_prefix_cache()
    res = stream_one(eng, pool[1000:1000 + prompt_len], int(line), f"m{i}")
    res["pool_stalls"] = _C.thread_pool_info()["num_stalls"]  # cumulative; grows only with the pool on
    print(json.dumps(res), flush=True)
"""


class EngineProcess:
    def __init__(self, env: dict, prompt_len: int, max_out: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, str(HERE), str(prompt_len), str(max_out)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **env})
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("engine process exited")
        return json.loads(line)

    def measure(self, n_out: int) -> dict:
        self.proc.stdin.write(f"{n_out}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def start_competitor(code: str | None):
    if code is None:
        return None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    time.sleep(0.5)  # let it reach its loop
    return proc


def parse_variant(spec: str) -> tuple[str, dict]:
    """"name:VAR=value,VAR=value" (e.g. "pool, no bind:PAGELLM_BIND=none")."""
    name, _, assignments = spec.partition(":")
    env = dict(kv.split("=", 1) for kv in assignments.split(",") if kv)
    return name, env


def run(args) -> dict:
    engines = {name: EngineProcess(env, args.prompt_len, args.output_len) for name, env in args.variants.items()}
    tpot: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(args.rounds):
            for cond, code in COMPETITORS.items():
                competitor = start_competitor(code)
                try:
                    for name, eng in engines.items():
                        res = eng.measure(args.output_len)
                        tpot.setdefault((name, cond), []).append(res["tpot_ms"])
                        print(f"[round {r}] {cond:18s} {name:24s} TPOT {res['tpot_ms']:8.2f} ms  "
                              f"(pool stalls so far {res['pool_stalls']})", flush=True)
                finally:
                    if competitor is not None:
                        competitor.kill()
                        competitor.wait()
    finally:
        for eng in engines.values():
            eng.close()
    return {"tpot_ms": {f"{n}|{c}": v for (n, c), v in tpot.items()}}


def render(data: dict) -> str:
    a = data["args"]
    med = {k: statistics.median(v) for k, v in data["tpot_ms"].items()}
    out = [f"# Batch-1 decode under CPU contention ({data['tag']})", "",
           f"{os.cpu_count()} CPUs (affinity {len(os.sched_getaffinity(0))}), load average before "
           f"{data['load_before']}, after {data['load_after']}. Default model, prompt {a['prompt_len']}, "
           f"{a['output_len']} new tokens, {a['rounds']} interleaved rounds, median TPOT (ms).", "",
           "| variant | " + " | ".join([*COMPETITORS, *(f"{c} / quiet" for c in COMPETITORS if c != "quiet")]) + " |",
           "|---" * (2 * len(COMPETITORS)) + "|"]
    for name in a["variants"]:
        quiet = med[f"{name}|quiet"]
        cells = [f"{med[f'{name}|{c}']:.2f}" for c in COMPETITORS]
        ratios = [f"{med[f'{name}|{c}'] / quiet:.2f}x" for c in COMPETITORS if c != "quiet"]
        out.append(f"| {name} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tag", default="quick")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:VAR=V,...",
                    help="an extra engine variant with these environment variables (repeatable)")
    args = ap.parse_args()
    args.variants = {**VARIANTS, **dict(parse_variant(v) for v in args.variant)}
    data = {"tag": args.tag, "args": vars(args), "load_before": tuple(round(x, 2) for x in os.getloadavg())}
    data.update(run(args))
    data["load_after"] = tuple(round(x, 2) for x in os.getloadavg())
    md = render(data)
    print("\n" + md, flush=True)
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / f"contention_{args.tag}.md").write_text(md + "\n")
    (results / f"contention_{args.tag}.json").write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
