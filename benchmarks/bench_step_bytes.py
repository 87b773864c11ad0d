#!/usr/bin/env python
"""One batch-1 decode step op by op: the bytes each op must read, its time, and so its memory-bandwidth use
(issue 22's decomposition).

    python benchmarks/bench_step_bytes.py                  # default model, bf16
    python benchmarks/bench_step_bytes.py --dtype float32 --tag fp32

Three measurements of the same request shape (256-token prompt, greedy, batch 1):
  * phases (bench_step_profile's timers): the replayed forward, the LM head, each host phase, TPOT, median step;
  * per op and shape: torch.profiler over eager decode steps (the step graph off; ops run in the order and
    the memory state of a real step, so each projection streams its weight from DRAM as it would): calls per
    step, self time per call, the bytes the op must read (a linear: its weight; decode attention: the layer's
    K and V rows of the context; the small ops: their activations), GB/s and MBU against the read bandwidth;
  * the read bandwidth: the fastest of a few fp32 `torch.sum` passes over 512 MiB (every thread; a read-only
    stream, the weights' access pattern), beside the copy bandwidth (read + write) earlier sessions quoted.
The profiler adds ~1-2 us per recorded op, so the small ops' times are upper bounds; the sum of the forward's
ops against the replayed forward shows what replay, pool and gaps cost. Writes
benchmarks/results/step_bytes_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import bench_step_profile as B
import common as C
import torch


def read_bandwidth_gbs(nbytes: int = 512 << 20, iters: int = 6) -> float:
    """Fastest sum over a large fp32 tensor (torch's vectorized reduction, every thread): bytes read per second."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def op_bytes(name: str, shapes: list, kv_row_bytes: int, ctx: float, elem: int) -> tuple[float, str]:
    """Bytes an op must read per call, and what they are."""
    dims = [s for s in shapes if s]
    if name in ("linear_small_m", "linear_argmax") and len(dims) >= 3:  # linear_argmax: the greedy LM head
        n, k = dims[2]
        return n * k * elem, f"weight {n} x {k}"
    if name.startswith("paged_attention_decode"):
        return kv_row_bytes * ctx, f"K+V of {ctx:.0f} tokens"
    acts = sum(elem * _numel(s) for s in dims[:3] if len(s) <= 2 and _numel(s) < (1 << 20))
    return acts, "activations"


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def profile_by_shape(eng, prompt: list[int], n_out: int) -> tuple[dict, int]:
    """Self CPU us per (op, input shapes) over eager decode steps; and the number of steps."""
    from torch.profiler import ProfilerActivity, profile

    from pagellm import SamplingParams

    runner = eng.runner
    graphs, runner.step_graphs = runner.step_graphs, None
    try:
        sp = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0, detokenize=False)
        eng.add_request("bytes", {"prompt_token_ids": prompt}, sp)
        eng.step()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            steps = 0
            while eng.has_unfinished_requests():
                eng.step()
                steps += 1
    finally:
        runner.step_graphs = graphs
    rows = {}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key.startswith("pagellm::") or e.key.startswith("aten::"):
            if e.self_cpu_time_total <= 0:
                continue
            rows[(e.key, str(e.input_shapes))] = (e.count, e.self_cpu_time_total, e.input_shapes)
    return rows, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--model-size", default="default", choices=["default", "1b"])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tag", default="default")
    args = ap.parse_args()
    load0 = os.getloadavg()
    read_bw = read_bandwidth_gbs()
    copy_bw = C.copy_bandwidth_gbs()["best_gbs"]
    prompt = list(range(100, 100 + args.prompt_len))
    llm = B.make_llm(args.model_size, args.dtype, args.prompt_len + args.output_len + 16)
    eng = llm.llm_engine
    eng.warmup(prompt_lens=(args.prompt_len,), max_tokens=4)
    timers = B.StepTimers()
    undo = B.instrument(eng, timers)
    try:
        B.decode_run(eng, prompt, 8, "warm", True, timers)
        runs = []
        for i in range(args.repeats):
            eng.reset_prefix_cache()
            runs.append(B.decode_run(eng, prompt, args.output_len, f"r{i}", True, timers))
    finally:
        undo()
    phases = {k: statistics.median(r["median_phases_ms"][k] for r in runs) for k in B.PHASES}
    tpot = statistics.median(r["tpot_ms"] for r in runs)
    median_step = statistics.median(r["median_step_ms"] for r in runs)
    eng.reset_prefix_cache()
    prof, steps = profile_by_shape(eng, prompt, args.output_len)
    read_bw = max(read_bw, read_bandwidth_gbs())
    load1 = os.getloadavg()

    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    ctx = args.prompt_len + args.output_len / 2
    attn_calls = sum(c for (k, _), (c, _, _) in prof.items() if k.startswith("pagellm::paged_attention_decode"))
    kv_row = eng.kv_cache_bytes_per_token / max(1.0, attn_calls / steps)  # K + V bytes per token of one layer
    ops, total_us, total_bytes = [], 0.0, 0.0
    for (key, _), (count, self_us, shapes) in prof.items():
        name = key.split("::", 1)[1]
        per_call_bytes, what = op_bytes(name, shapes, kv_row, ctx, elem)
        calls = count / steps
        us = self_us / count
        ops.append({"op": name, "what": what, "calls_per_step": calls, "bytes_per_call": per_call_bytes,
                    "us_per_call": us, "ms_per_step": calls * us / 1e3, "gbs": per_call_bytes / us / 1e3 if us else 0})
        total_us += self_us / steps
        total_bytes += calls * per_call_bytes
    ops.sort(key=lambda r: r["ms_per_step"], reverse=True)
    data = {"env": C.env_info(), "args": vars(args), "load_before": load0, "load_after": load1, "read_gbs": read_bw,
            "copy_gbs": copy_bw, "phases_ms": phases, "tpot_ms": tpot, "median_step_ms": median_step, "ops": ops,
            "native_ms": total_us / 1e3, "native_bytes": total_bytes}
    md = render(data)
    print(md)
    C.save_results(f"step_bytes_{args.tag}", md, data)


def render(d: dict) -> str:
    rb = d["read_gbs"]
    lines = [f"# Batch-1 step, op by op ({d['args']['model_size']} {d['args']['dtype']}, tag {d['args']['tag']})", "",
             f"Load before {d['load_before'][0]:.2f}, after {d['load_after'][0]:.2f}. Read bandwidth (torch.sum, "
             f"fastest) {rb:.1f} GB/s; copy (read + write) {d['copy_gbs']:.1f} GB/s. MBU = GB/s / read bandwidth.", "",
             "| op | reads | calls / step | KB / call | us / call | GB/s | MBU | ms / step |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["ops"]:
        if r["ms_per_step"] < 0.005:
            continue
        mbu = r["gbs"] / rb if r["what"] != "activations" else float("nan")
        lines.append(f"| {r['op']} | {r['what']} | {r['calls_per_step']:.0f} | {r['bytes_per_call'] / 1e3:.1f} | "
                     f"{r['us_per_call']:.1f} | {r['gbs']:.1f} | {'' if mbu != mbu else f'{mbu:.2f}'} | "
                     f"{r['ms_per_step']:.3f} |")
    p = d["phases_ms"]
    fwd, head = p["forward"], p["LM head"]
    host = sum(v for k, v in p.items() if k not in ("forward", "LM head"))
    lines += ["", f"Every native op of an eager step (profiled): {d['native_ms']:.3f} ms, reading "
                  f"{d['native_bytes'] / 1e6:.1f} MB (at the read bandwidth: {d['native_bytes'] / rb / 1e6:.3f} ms).",
              "", "| part (median step, replayed) | ms |", "|---|---:|",
              f"| forward (step-graph replay) | {fwd:.3f} |", f"| LM head | {head:.3f} |",
              f"| host (every other phase) | {host:.3f} |",
              f"| sum | {fwd + head + host:.3f} |", f"| median step | {d['median_step_ms']:.3f} |",
              f"| TPOT (mean step) | {d['tpot_ms']:.3f} |", "",
              "Host phases (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in p.items() if k not in ("forward", "LM head"))]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
