#!/usr/bin/env python3
"""Data-parallel serving throughput: `pagellm serve --data-parallel-size 2` vs 1 on the chat mix.

    python benchmarks/bench_dp_serve.py --model /path/to/SmolLM2-135M-Instruct --num-prompts 64
    python benchmarks/bench_dp_serve.py --model TINY_DIR --num-prompts 4 --output-len 8 --sizes 1,2   # smoke run

For each size, one `pagellm serve` (DP=1: the plain server on every allowed CPU; DP=N: N replicas, each pinned
to 1/N of them, behind the routing front) is started, the serving benchmark (bench_serving.py: all requests at
once unless --request-rate, streamed /v1/completions of the built-in chat prompts) runs against it, and it is
stopped with SIGTERM. Prints request and output-token throughput per size and the speed-up over the first.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_serving  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model: str | None, dp: int, routing: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", *([model] if model else []), "--port", str(port),
           "--data-parallel-size", str(dp), "--dp-routing", routing, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"DP={dp} server exited {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise SystemExit(f"DP={dp} server not up after 900 s")
        time.sleep(0.5)


def _stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: `pagellm serve`'s default model)")
    p.add_argument("--sizes", default="1,2", help="data-parallel sizes to compare (default 1,2)")
    p.add_argument("--dp-routing", default="least_loaded", choices=("least_loaded", "prefix"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=None, help="every request's output length (default: the mix's)")
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--serve-args", default="", help="more `pagellm serve` options, one string (e.g. '--dtype bfloat16')")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    rows = []
    for dp in sizes:
        proc, url = _start_server(a.model, dp, a.dp_routing, a.serve_args.split())
        try:
            bench_argv = ["--base-url", url, "--builtin-mix", "chat", "--num-prompts", str(a.num_prompts),
                          "--request-rate", a.request_rate, "--label", f"dp{dp}", "--no-save", "--seed", "0"]
            if a.output_len:
                bench_argv += ["--output-len", str(a.output_len)]
            if a.model:
                bench_argv += ["--tokenizer", a.model]
            s = bench_serving.main(bench_serving.add_bench_args(argparse.ArgumentParser()).parse_args(bench_argv))[0]
        finally:
            _stop_server(proc)
        rows.append((dp, s))
    base = rows[0][1]["output_throughput"] or float("nan")
    print(f"\n{'DP':>3} {'completed':>9} {'failed':>6} {'req/s':>8} {'out tok/s':>10} {'speed-up':>8}")
    for dp, s in rows:
        print(f"{dp:>3} {s['completed']:>9} {s['failed']:>6} {s['request_throughput']:>8.2f} "
              f"{s['output_throughput']:>10.1f} {s['output_throughput'] / base:>7.2f}x")


if __name__ == "__main__":
    main()
