#!/usr/bin/env python
"""Decode TPOT of three decode paths in one interleaved run: step-graph replay, eager, and the old fused op.

    python benchmarks/bench_decode_paths.py                        # batches 1,8,32; bf16 and fp32; 5 rounds
    python benchmarks/bench_decode_paths.py --batches 1 --dtypes float32 --rounds 1 --max-tokens 8 --tag smoke

Paths (the default model, SmolLM2-135M-Instruct):
* new:   this working tree, default settings: decode-only steps replay a captured step graph;
* eager: this working tree with LLM(enforce_eager=True): every step runs the module forward;
* fused: the baseline commit (default: the newest commit that still has csrc/ops/fused/decode_layer_cpu.cpp),
         default settings: each decoder layer of a decode-only step is one torch.ops.pagellm.fused_decode_layer.

The baseline is checked out with `git worktree add --detach` under build/ (git-ignored) and its _C
extension built there with cmake (same venv python, Release, under flock /tmp/pagellm-build.lock); both are
reused when present. Every (path, dtype) is one worker process (decode_paths_worker.py) that loads the model
once and then measures on request, so the two code versions never share an interpreter and no model load
is timed. Each round visits every (dtype, batch) and, within it, every path, in an order rotated from
cell to cell. TPOT per request = (last - first token time) / (tokens - 1), the median over the batch's
requests; the table gives the median over rounds (min-max). Writes benchmarks/results/decode_paths_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import common as C

PATHS = ("new", "eager", "fused")
FUSED_OP_SOURCE = "csrc/ops/fused/decode_layer_cpu.cpp"
BUILD_LOCK = "/tmp/pagellm-build.lock"
WORKER = Path(__file__).resolve().parent / "decode_paths_worker.py"


# ---------------------------------------------------------------------------------- baseline tree
def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(C.REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def default_baseline() -> str:
    """The newest commit that still has the fused decode op: HEAD, or the parent of the commit that deleted it."""
    if subprocess.run(["git", "-C", str(C.REPO), "cat-file", "-e", f"HEAD:{FUSED_OP_SOURCE}"],
                      capture_output=True).returncode == 0:
        return git("rev-parse", "HEAD")
    deleted_in = git("rev-list", "-1", "HEAD", "--", FUSED_OP_SOURCE)
    return git("rev-parse", f"{deleted_in}^")


def ensure_baseline(commit: str, tree: Path, python: str) -> Path:
    """A worktree of `commit` at `tree` with its own pagellm/_C*.so built; nothing is done when the .so exists."""
    ext_dir = tree / "python" / "pagellm"
    if list(ext_dir.glob("_C*.so")):
        return tree
    with open(BUILD_LOCK, "a") as lock:
        print(f"[baseline] waiting for {BUILD_LOCK}", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)  # the same lock as `flock /tmp/pagellm-build.lock` (flock(2))
        if list(ext_dir.glob("_C*.so")):
            return tree
        if not (tree / ".git").exists():
            git("worktree", "add", "--detach", str(tree), commit)
        build = tree / "build" / "ext"
        t0 = time.time()
        subprocess.run(["cmake", "-S", str(tree), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                        "-DPAGELLM_BUILD_EXTENSION=ON", "-DBUILD_TESTING=OFF", "-DPAGELLM_CUDA_COMPILE_CHECK=OFF",
                        f"-DPython_EXECUTABLE={python}"], check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "_C", "-j2"], check=True)
        built = list(build.rglob("_C*.so"))
        if len(built) != 1:
            raise RuntimeError(f"expected one _C*.so under {build}, found {built}")
        shutil.copy2(built[0], ext_dir / built[0].name)
        print(f"[baseline] built {ext_dir / built[0].name} in {time.time() - t0:.0f}s", flush=True)
    return tree


# ---------------------------------------------------------------------------------- workers
class Worker:
    """One worker process: a (path, dtype) with its model loaded; measure() sends one request and waits."""

    def __init__(self, path: str, dtype: str, tree: Path, python: str, args) -> None:
        self.name = f"{path}/{dtype}"
        cmd = [python, str(WORKER), "--tree", str(tree), "--path", path, "--dtype", dtype,
               "--max-num-seqs", str(max(max(args.batches), 8)), "--kv-cache-gb", str(args.kv_cache_gb),
               "--threads", str(args.threads)]
        env = {k: v for k, v in os.environ.items()
               if k not in ("PAGELLM_STEP_GRAPH", "PAGELLM_FUSED_DECODE")}  # each path at its defaults
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info: dict = {}

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited (rc {self.proc.wait()}); see its stderr above")
        return json.loads(line)

    def measure(self, batch: int, max_tokens: int, prompt_len: int) -> dict:
        self.proc.stdin.write(json.dumps({"batch": batch, "max_tokens": max_tokens, "prompt_len": prompt_len}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------------- host state
def host_snapshot() -> dict:
    """1/5/15-min load average and the aggregate CPU counters of /proc/stat (jiffies)."""
    load = open("/proc/loadavg").read().split()[:3]
    cpu = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return {"time": time.time(), "loadavg": [float(v) for v in load], "cpu_total": sum(cpu[:8]),
            "cpu_steal": cpu[7] if len(cpu) > 7 else 0}


def steal_pct(before: dict, after: dict) -> float:
    total = after["cpu_total"] - before["cpu_total"]
    return 100.0 * (after["cpu_steal"] - before["cpu_steal"]) / total if total > 0 else 0.0


# ---------------------------------------------------------------------------------- run
def run_rounds(workers: dict, args) -> tuple[list[dict], list[dict]]:
    """Warm-up (every worker, every batch, untimed), then args.rounds interleaved rounds.
    Returns (measurements, per-round host records)."""
    for (path, dtype), w in workers.items():
        for batch in args.batches:
            w.measure(batch, args.max_tokens, args.prompt_len)
        print(f"[warm-up] {w.name} done", flush=True)
    results, rounds = [], []
    for r in range(args.rounds):
        before = host_snapshot()
        cell = 0
        for dtype in args.dtypes:
            for batch in args.batches:
                shift = (r + cell) % len(PATHS)
                for pos, path in enumerate(PATHS[shift:] + PATHS[:shift]):
                    res = workers[(path, dtype)].measure(batch, args.max_tokens, args.prompt_len)
                    res.update(round=r, path=path, dtype=dtype, position=pos)
                    results.append(res)
                    print(f"[round {r}] {dtype} batch {batch} {path}: TPOT {res['tpot_ms']:.2f} ms", flush=True)
                cell += 1
        after = host_snapshot()
        rounds.append({"round": r, "loadavg_before": before["loadavg"], "loadavg_after": after["loadavg"],
                       "steal_pct": steal_pct(before, after), "seconds": after["time"] - before["time"]})
        print(f"[round {r}] load {before['loadavg'][0]:.2f} -> {after['loadavg'][0]:.2f}, "
              f"steal {rounds[-1]['steal_pct']:.1f} %", flush=True)
    return results, rounds


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (len of the shorter when one is a prefix), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def same_tokens(cell: dict) -> tuple[str, dict]:
    """Request 0's greedy tokens across paths (first round) and across rounds within each path."""
    first = {p: rs[0]["tokens0"] for p, rs in cell.items()}
    diffs = {}
    for a, b in (("new", "fused"), ("new", "eager"), ("eager", "fused")):
        if a in first and b in first:
            i = first_difference(first[a], first[b])
            if i is not None:
                diffs[f"{a}/{b}"] = i
    unstable = [p for p, rs in cell.items() if any(r["tokens0"] != rs[0]["tokens0"] for r in rs)]
    all_same = len({rs[0]["all_tokens_sha1"] for rs in cell.values()}) == 1
    text = "yes" if not diffs else "no: " + ", ".join(f"{k} from token {i}" for k, i in diffs.items())
    if not diffs and not all_same:
        text += " (req 0; other requests differ)"
    if unstable:
        text += f"; varies across rounds: {', '.join(unstable)}"
    return text, {"first_difference": diffs, "all_requests_same": all_same, "unstable_paths": unstable}


def summarize(results: list[dict], args) -> tuple[list[list], list[dict]]:
    rows, cells = [], []
    for dtype in args.dtypes:
        for batch in args.batches:
            cell = {p: [r for r in results if r["path"] == p and r["dtype"] == dtype and r["batch"] == batch]
                    for p in PATHS}
            med = {p: statistics.median(r["tpot_ms"] for r in rs) for p, rs in cell.items()}
            span = {p: (min(r["tpot_ms"] for r in rs), max(r["tpot_ms"] for r in rs)) for p, rs in cell.items()}
            text, tok = same_tokens(cell)
            rows.append([dtype, batch, *(f"{med[p]:.2f} ({span[p][0]:.2f}-{span[p][1]:.2f})" for p in PATHS),
                         *(f"{batch / med[p] * 1e3:.0f}" for p in PATHS),
                         f"{med['new'] / med['fused']:.3f}", f"{med['new'] / med['eager']:.3f}", text])
            cells.append({"dtype": dtype, "batch": batch, "tpot_ms_median": med, "tpot_ms_min_max": span,
                          "decode_tok_s": {p: batch / med[p] * 1e3 for p in PATHS},
                          "new_over_fused": med["new"] / med["fused"], "new_over_eager": med["new"] / med["eager"],
                          "graph_replays_new": [r["graph_replays"] for r in cell["new"]], **tok})
    return rows, cells


def report(rows, rounds, meta, args) -> str:
    headers = ["dtype", "batch", *(f"{p} TPOT ms" for p in PATHS), *(f"{p} tok/s" for p in PATHS),
               "new/fused", "new/eager", "same tokens (req 0)"]
    host = C.md_table(["round", "load before", "load after", "CPU steal %", "s"],
                      [[r["round"], f"{r['loadavg_before'][0]:.2f}", f"{r['loadavg_after'][0]:.2f}",
                        f"{r['steal_pct']:.1f}", f"{r['seconds']:.0f}"] for r in rounds])
    return "\n".join([
        f"# Decode paths: TPOT by path ({meta['env']['time']}, {meta['env']['cpu']}, {meta['env']['nproc']} CPUs)",
        "",
        f"new = working tree on {meta['new_head'][:10]}{' (dirty)' if meta['new_dirty'] else ''}, step-graph replay; "
        f"eager = same tree, enforce_eager=True; fused = {meta['baseline_commit'][:10]}, fused_decode_layer.",
        f"Default model, prompt {args.prompt_len} tokens, {args.max_tokens} new tokens (greedy, ignore_eos), "
        f"rounds: {args.rounds}, interleaved; TPOT median over rounds (min-max); tok/s = batch / TPOT; "
        "ratios < 1: new is faster.",
        "", C.md_table(headers, rows), "", host, ""])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each worker (0: torch's default)")
    ap.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache of each worker (GiB)")
    ap.add_argument("--baseline", default=None, help="baseline commit (default: newest one with the fused op)")
    ap.add_argument("--baseline-dir", type=Path, default=None, help="default build/baseline-<shortsha>")
    ap.add_argument("--python", default=str(C.REPO / ".venv" / "bin" / "python"))
    ap.add_argument("--tag", default=f"cpu{os.cpu_count()}")
    ap.add_argument("--setup-only", action="store_true", help="set up the baseline tree and build, then exit")
    args = ap.parse_args(argv)
    bad = [d for d in args.dtypes if d not in ("bfloat16", "float32", "float16")]
    if bad or args.rounds < 1 or args.max_tokens < 2 or min(args.batches) < 1:
        ap.error(f"dtypes in bfloat16,float32,float16 (got {args.dtypes}); rounds >= 1; max-tokens >= 2; batches >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    commit = git("rev-parse", args.baseline) if args.baseline else default_baseline()
    tree = args.baseline_dir or C.REPO / "build" / f"baseline-{commit[:7]}"
    ensure_baseline(commit, tree.resolve(), args.python)
    if args.setup_only:
        print(f"[baseline] {commit[:10]} ready at {tree}", flush=True)
        return
    dirty = bool(git("status", "--porcelain", "--", "python", "csrc"))
    meta = {"args": vars(args) | {"baseline_dir": str(tree)}, "baseline_commit": commit,
            "new_head": git("rev-parse", "HEAD"), "new_dirty": dirty, "env": C.env_info()}
    trees = {"new": C.REPO, "eager": C.REPO, "fused": tree.resolve()}
    workers = {}
    try:
        for dtype in args.dtypes:
            for path in PATHS:
                workers[(path, dtype)] = Worker(path, dtype, trees[path], args.python, args)
        for w in workers.values():
            w.info = w.read()
            print(f"[ready] {w.name}: pagellm {w.info['pagellm_file']}, load {w.info['load_s']:.1f}s", flush=True)
        results, rounds = run_rounds(workers, args)
    finally:
        for w in workers.values():
            w.close()
    rows, cells = summarize(results, args)
    md = report(rows, rounds, meta, args)
    print("\n" + md, flush=True)
    data = {**meta, "workers": {w.name: w.info for w in workers.values()}, "rounds": rounds, "cells": cells,
            "measurements": results}
    C.save_results(f"decode_paths_{args.tag}", md, data)


if __name__ == "__main__":
    main()
