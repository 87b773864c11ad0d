#!/usr/bin/env python
"""Worker of bench_decode_paths.py: one decode path, one dtype, one loaded model, measured on request.

    python benchmarks/decode_paths_worker.py --tree /work/main --path new|eager|fused --dtype bfloat16

Imports pagellm from `--tree` only (for a tree other than the editable install, the install's import
hook is removed first and `<tree>/python` goes first on sys.path), builds the LLM once, then answers
one JSON line on stdout per JSON line on stdin:

    -> {"batch": 8, "max_tokens": 64, "prompt_len": 32}
    <- {"tpot_ms": ..., "tpot_ms_per_request": [...], "ttft_ms": ..., "generate_s": ..., "tokens0": [...], ...}

The first line it writes is {"ready": true, "pagellm_file": ..., ...}. Anything else the process prints
(logs, C++ output) goes to stderr, so stdout carries the protocol only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

PATHS = ("new", "eager", "fused")
# Distinct first words make every request of a batch its own prompt (no shared prefix to reuse).
PASSAGE = (
    "The paged KV cache splits every sequence's keys and values into fixed-size blocks, so that memory is "
    "allocated as a sequence grows and freed the moment it finishes, and the scheduler can batch requests "
    "of any length together without reserving the longest possible context for each of them."
)


def import_pagellm(tree: Path, use_editable_install: bool):
    """Import pagellm from tree/python. use_editable_install: keep the venv's editable-install finder (the
    tree is the installed one); otherwise remove it, so that tree/python wins over the installed copy."""
    if not use_editable_install:
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__module__ != "_editable_skbc_pagellm"]
        for name in [n for n in sys.modules if n == "pagellm" or n.startswith("pagellm.")]:
            del sys.modules[name]
        sys.path.insert(0, str(tree / "python"))
    import pagellm

    expected = (tree / "python" / "pagellm").resolve()
    got = Path(pagellm.__file__).resolve()
    if got.parent != expected:
        raise RuntimeError(f"pagellm imported from {got}, expected {expected}/__init__.py")
    return pagellm


def check_path(llm, path: str) -> dict:
    """Fail unless the engine's model runner is set up for `path`; returns what was checked."""
    runner = llm.llm_engine.runner
    if path == "fused":
        ok = getattr(runner, "fused_decode", False) is True
        facts = {"fused_decode": getattr(runner, "fused_decode", None)}
    else:
        if not hasattr(runner, "step_graphs"):
            raise RuntimeError("this tree's ModelRunner has no step_graphs: not the step-graph code")
        ok = (runner.step_graphs is not None) == (path == "new")
        facts = {"step_graphs": runner.step_graphs is not None}
    if not ok:
        raise RuntimeError(f"model runner is not on the {path!r} path: {facts}")
    return facts


def make_prompts(tokenizer, batch: int, prompt_len: int) -> list[list[int]]:
    """batch distinct prompts of exactly prompt_len token ids."""
    prompts = []
    for i in range(batch):
        ids = tokenizer.encode(f"Note {i}. {PASSAGE} {PASSAGE}", add_special_tokens=False)
        if len(ids) < prompt_len:
            raise ValueError(f"prompt_len {prompt_len} > the {len(ids)} tokens of the prompt text")
        prompts.append(ids[:prompt_len])
    if len({tuple(p) for p in prompts}) != batch:
        raise RuntimeError("prompts are not distinct")
    return prompts


def graph_counts(llm) -> tuple[int, int]:
    graphs = getattr(llm.llm_engine.runner, "step_graphs", None)
    return (graphs.num_replays, graphs.num_captures) if graphs is not None else (0, 0)


def measure(llm, sampling_params_cls, batch: int, max_tokens: int, prompt_len: int) -> dict:
    """One generate of `batch` prompts; TPOT per request = (last - first token time) / (tokens - 1)."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2 (TPOT needs two tokens), got {max_tokens}")
    prompts = make_prompts(llm.get_tokenizer(), batch, prompt_len)
    sp = sampling_params_cls(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    replays0, captures0 = graph_counts(llm)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    replays1, captures1 = graph_counts(llm)
    tpots, ttfts = [], []
    for o in outs:
        n, m = len(o.outputs[0].token_ids), o.metrics
        if n != max_tokens:
            raise RuntimeError(f"request {o.request_id} produced {n} tokens, asked for {max_tokens}")
        tpots.append((m.last_token_time - m.first_token_time) / (n - 1) * 1e3)
        ttfts.append((m.first_token_time - m.arrival_time) * 1e3)
    all_tokens = json.dumps([o.outputs[0].token_ids for o in outs]).encode()
    return {
        "batch": batch, "max_tokens": max_tokens, "prompt_len": prompt_len,
        "tpot_ms": statistics.median(tpots), "tpot_ms_per_request": tpots, "ttft_ms": statistics.median(ttfts),
        "generate_s": generate_s, "tokens0": list(outs[0].outputs[0].token_ids),
        "all_tokens_sha1": hashlib.sha1(all_tokens).hexdigest(),
        "graph_replays": replays1 - replays0, "graph_captures": captures1 - captures0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", type=Path, required=True, help="source tree whose python/pagellm to import")
    ap.add_argument("--path", choices=PATHS, required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-gb", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()

    # stdout is the protocol channel: keep a private copy of it and send fd 1 (print, C++ output) to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    tree = args.tree.resolve()
    installed = Path(__file__).resolve().parent.parent
    pagellm = import_pagellm(tree, use_editable_install=(tree == installed))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    llm = pagellm.LLM(dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      kv_cache_memory_gb=args.kv_cache_gb, **({"enforce_eager": True} if args.path == "eager" else {}))
    facts = check_path(llm, args.path)
    c_mod = sys.modules.get("pagellm._C")
    if tree != installed and not str(Path(getattr(c_mod, "__file__", "/")).resolve()).startswith(str(tree) + "/"):
        raise RuntimeError(f"pagellm._C loaded from {getattr(c_mod, '__file__', None)}, not from {tree}")
    ready = {"ready": True, "path": args.path, "dtype": args.dtype, "pagellm_file": pagellm.__file__,
             "pagellm_C_file": getattr(c_mod, "__file__", None), "load_s": time.perf_counter() - t0,
             "torch_threads": torch.get_num_threads(), "pid": os.getpid(), **facts}
    print(f"[worker {args.path}/{args.dtype}] pagellm from {pagellm.__file__}, _C from {ready['pagellm_C_file']}",
          file=sys.stderr, flush=True)
    proto.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        res = measure(llm, pagellm.SamplingParams, int(req["batch"]), int(req["max_tokens"]), int(req["prompt_len"]))
        proto.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
