"""`pagellm bench serve ...`: the online serving benchmark (benchmarks/bench_serving.py).

The benchmark code lives in the repository's benchmarks/ directory (not in the wheel); this entry
point finds it next to the package source (editable install) or through $PAGELLM_BENCHMARKS_DIR.

Hook into the CLI with:
    from pagellm.entrypoints import bench
    bench.add_bench_parser(subparsers)       # `pagellm bench serve ...`, sets func=bench.run
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path


def _benchmarks_dir() -> Path:
    env = os.environ.get("PAGELLM_BENCHMARKS_DIR")
    candidates = [Path(env)] if env else []
    candidates += [Path(__file__).resolve().parents[3] / "benchmarks", Path.cwd() / "benchmarks"]
    for c in candidates:
        if (c / "bench_serving.py").is_file():
            return c
    raise SystemExit("pagellm bench serve: benchmarks/bench_serving.py not found; run from a source checkout "
                     "or set PAGELLM_BENCHMARKS_DIR")


def _load():
    d = str(_benchmarks_dir())
    if d not in sys.path:
        sys.path.insert(0, d)
    return importlib.import_module("bench_serving")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmarks (serve: online serving latency/throughput)")
    sub = p.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser("serve", help="benchmark an OpenAI-compatible server",
                           description="Poisson/gamma arrivals against /v1/completions; TTFT, TPOT, ITL, E2E, goodput.")
    try:
        _load().add_bench_args(serve)
    except SystemExit:
        serve.add_argument("rest", nargs=argparse.REMAINDER)
    serve.set_defaults(func=run)
    return p


def run(args) -> int:
    _load().main(args)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pagellm")
    add_bench_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
