"""Where a batch-1 decode step's time goes on the GPU (issue 21's MBU target), in one process:

1. each linear's shape at M = 1, 4 and 8 through cuBLAS and through every `linear_gemv` variant (GEMV_VARIANTS:
   kernel 1, 2, 3, 4, with and without PDL), captured in a CUDA graph over rotating weight copies (so the 50 MB L2 cache
   does not hold them): achieved GB/s against the copy bandwidth of the same run;
2. the ~1.1B bf16 model of bench_gpu.py under `torch.profiler` for a batch-1 generation with CUDA graphs: wall time
   per token, GPU kernel time per token, and the kernels that take it (the host loop is the difference), with the
   kernels per layer and us per call: under the environment's dispatch and fusions, and again with every fusion off
   (ops/fused_dispatch.py, PAGELLM_CUDA_FUSE_DECODE_REDUCE);
3. the batch-1 graph replay time under each STEP_VARIANTS entry (GEMV kernel, PDL, decode split grain, which
   fusions): graphs recaptured per variant, variants interleaved over rounds; medians.

Prints tables last; writes profile_step.json and the profiler tables under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import pagellm.ops  # noqa: F401  (registers torch.ops.pagellm, linear_small_m among them)

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu import ceilings, cuda_median_ms, make_model  # noqa: E402


# (label, CUDA_GEMV_MAX_M, kernel, pdl): cuBLAS, then linear_gemv's kernels (docs/cuda.md)
GEMV_VARIANTS = [("cublas", 0, 1, False), ("k1", 8, 1, False), ("k2", 8, 2, False), ("k3", 8, 3, False),
                 ("k4", 8, 4, False), ("k2_pdl", 8, 2, True), ("k3_pdl", 8, 3, True), ("k4_pdl", 8, 4, True)]
# The fusions (ops/fused_dispatch.py; "reduce" is the C++ switch PAGELLM_CUDA_FUSE_DECODE_REDUCE).
FUSIONS = ("reduce", "rope_cache", "norm_gemv", "act_gemv")
ALL = frozenset(FUSIONS)
# the batch-1 step: (label, CUDA_GEMV_MAX_M, kernel, pdl, split grain ("" = the kernel's default), fusions on)
STEP_VARIANTS = [
    ("cublas", 0, 4, True, "", frozenset()),
    ("cublas+reduce+rope", 0, 4, True, "", frozenset({"reduce", "rope_cache"})),
    ("k4_pdl", 1, 4, True, "", frozenset()),  # session 19's defaults, no fusion
    *[(f"k4_pdl+{f}", 1, 4, True, "", frozenset({f})) for f in FUSIONS],
    ("k4_pdl+all", 1, 4, True, "", ALL),  # this session's defaults
    ("k2_pdl+all", 1, 2, True, "", ALL),
    ("k4_pdl+all_grain32", 1, 4, True, "32", ALL),
    ("k4_pdl+all_grain128", 1, 4, True, "128", ALL),
]


def set_variant(max_m: int, kernel: int, pdl: bool, grain: str, fusions: frozenset) -> None:
    """The dispatch a graph captured next uses (module attributes read while capturing, env read by the C++ glue)."""
    from pagellm.ops import fused_dispatch, linear_dispatch

    linear_dispatch.CUDA_GEMV_MAX_M, linear_dispatch.CUDA_GEMV_KERNEL = max_m, kernel
    linear_dispatch.CUDA_GEMV_PDL = pdl
    fused_dispatch.CUDA_FUSE_ROPE_CACHE = "rope_cache" in fusions
    fused_dispatch.CUDA_FUSE_NORM_GEMV = "norm_gemv" in fusions
    fused_dispatch.CUDA_FUSE_ACT_GEMV = "act_gemv" in fusions
    os.environ["PAGELLM_CUDA_FUSE_DECODE_REDUCE"] = "1" if "reduce" in fusions else "0"
    os.environ["PAGELLM_CUDA_DECODE_SPLIT_GRAIN"] = grain


def current_variant() -> tuple:
    from pagellm.ops import fused_dispatch, linear_dispatch

    fusions = {name for name, on in (("rope_cache", fused_dispatch.CUDA_FUSE_ROPE_CACHE),
                                     ("norm_gemv", fused_dispatch.CUDA_FUSE_NORM_GEMV),
                                     ("act_gemv", fused_dispatch.CUDA_FUSE_ACT_GEMV),
                                     ("reduce", os.environ.get("PAGELLM_CUDA_FUSE_DECODE_REDUCE", "1") == "1")) if on}
    return (linear_dispatch.CUDA_GEMV_MAX_M, linear_dispatch.CUDA_GEMV_KERNEL, linear_dispatch.CUDA_GEMV_PDL,
            os.environ.get("PAGELLM_CUDA_DECODE_SPLIT_GRAIN", ""), frozenset(fusions))


def linear_rates(shapes: dict[str, tuple[int, int]], copy_gbs: float, m: int = 1) -> list[dict]:
    rows = []
    for name, (n_in, n_out) in shapes.items():
        copies = max(2, int(200e6 // (n_in * n_out * 2)))  # >= 200 MB of weights per pass: past the L2 cache
        ws = [torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n_out, device="cuda", dtype=torch.bfloat16)
        row = dict(name=name, n_in=n_in, n_out=n_out, m=m)
        for tag, _, kernel, pdl in GEMV_VARIANTS:
            if tag == "cublas":
                fn = lambda w: torch.matmul(x, w.t(), out=out)  # noqa: E731
            else:
                fn = lambda w, k=kernel, p=pdl: torch.ops.pagellm.linear_gemv(out, x, w, None, k, p)  # noqa: E731
            try:
                for w in ws:  # warm-up outside the capture (cuBLAS picks its kernel and workspace)
                    fn(w)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for w in ws:
                        fn(w)
                ms = cuda_median_ms(graph.replay, iters=20) / copies
                row[f"{tag}_us"] = ms * 1e3
                row[f"{tag}_of_copy"] = n_in * n_out * 2 / ms / 1e6 / copy_gbs
            except RuntimeError as e:  # one variant failing (e.g. PDL in a capture) leaves the others their row
                print(f"{name} M={m} {tag}: {type(e).__name__}: {e}"[:300], flush=True)
                torch.cuda.synchronize()
        rows.append(row)
        del ws
    torch.cuda.empty_cache()
    return rows


def replay_by_variant(llm, prompt, rounds: int = 3, tokens: int = 16) -> dict[str, dict]:
    """Batch-1 graph replay ms (median over rounds of 50-replay medians) under each STEP_VARIANTS entry: the graphs
    are recaptured per variant (the dispatch, the fusions and the split grain are read while capturing); variants
    interleaved in every round."""
    from pagellm import SamplingParams

    runner = llm.llm_engine.executor.driver_worker.runner
    graphs = runner.cuda_graphs
    saved = current_variant()
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    res: dict[str, dict] = {v[0]: dict(replay_ms=[], wall_ms_per_token=[]) for v in STEP_VARIANTS}
    for _ in range(rounds):
        for tag, *variant in STEP_VARIANTS:
            set_variant(*variant)
            graphs.invalidate()
            runner.cuda_graphs = graphs  # a failed capture sets it to None: the next variant gets it back
            try:
                llm.generate(prompt, sp, use_tqdm=False)  # captures bucket 1 under this variant
            except Exception as e:  # one variant failing leaves the others their rows
                res[tag]["error"] = f"{type(e).__name__}: {e}"[:200]
                continue
            if runner.cuda_graphs is None or 1 not in graphs.captured_buckets:
                res[tag]["error"] = "no batch-1 graph (capture failed: see the log)"
                continue
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompt, sp, use_tqdm=False)
            torch.cuda.synchronize()
            res[tag]["wall_ms_per_token"].append((time.perf_counter() - t0) * 1e3 / tokens)
            res[tag]["replay_ms"].append(cuda_median_ms(lambda: graphs.replay(1), iters=50))
    set_variant(*saved)
    runner.cuda_graphs = graphs
    graphs.invalidate()
    for r in res.values():
        for k in ("replay_ms", "wall_ms_per_token"):
            r[f"{k}_median"] = statistics.median(r[k]) if r[k] else float("nan")
    return res


def profile_generation(llm, prompt, sp, tokens: int, out: Path, tag: str, num_layers: int) -> dict:
    """Wall ms/token, GPU kernel ms/token, the top kernels and every GPU kernel's launches per token / per layer and
    us per launch of one profiled generation."""
    from torch.profiler import ProfilerActivity, profile

    res = {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompt, sp, use_tqdm=False)
    torch.cuda.synchronize()
    res["wall_ms_per_token"] = (time.perf_counter() - t0) * 1e3 / tokens
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, sp, use_tqdm=False)
        torch.cuda.synchronize()
    events = prof.key_averages()
    table = events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70)
    (out / f"profile_{tag}.txt").write_text(table)
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    res["gpu_ms_per_token"] = gpu_us / 1e3 / tokens
    res["top_kernels"] = sorted(((e.key[:80], round(e.self_device_time_total / tokens, 1))
                                 for e in events if e.self_device_time_total > 0), key=lambda kv: -kv[1])[:15]
    # GPU kernels only (device-side events): launches per token and per layer, us per launch (the prompt's prefill
    # step is one of the `tokens` steps)
    res["kernels"] = sorted(([e.key[:70], e.count / tokens, e.count / tokens / num_layers,
                              e.self_device_time_total / e.count, e.self_device_time_total / tokens]
                             for e in kernels), key=lambda r: -r[4])
    res["kernels_per_token"] = sum(e.count for e in kernels) / tokens
    print(tag, "profiler table:\n" + table, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gpu-out")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the per-variant replay timing")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__)
    res.update(ceilings())
    tmp = Path(tempfile.mkdtemp())
    hf, cfg = make_model(tmp / "llama-1b")
    del hf
    torch.cuda.empty_cache()
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * h // cfg.num_attention_heads
    shapes = {"qkv_proj": (h, h + 2 * kv), "o_proj": (h, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h),
              "lm_head": (h, v)}
    res["linears"] = [r for m in (1, 4, 8) for r in linear_rates(shapes, res["copy_gbs"], m)]
    print_linear_table(res, shapes, cfg)

    from pagellm import LLM, SamplingParams

    llm = LLM(str(tmp / "llama-1b"), device="cuda", dtype="bfloat16", max_model_len=4096, seed=0,
              kv_cache_memory_gb=16, max_num_seqs=64, enable_prefix_caching=False)
    prompt = [{"prompt_token_ids": list(range(5, 133))}]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.tokens, ignore_eos=True)
    for sp in (greedy, sampled):  # warm-up: graphs captured, sampler kernels loaded
        llm.generate(prompt, sp, use_tqdm=False)
    layers = cfg.num_hidden_layers
    res["profiles"] = {tag: profile_generation(llm, prompt, sp, args.tokens, out, tag, layers)
                       for tag, sp in (("greedy", greedy), ("sampled", sampled))}
    graphs = llm.llm_engine.executor.driver_worker.runner.cuda_graphs
    if graphs is not None and 1 in graphs.captured_buckets:
        res["b1_replay_ms"] = cuda_median_ms(lambda: graphs.replay(1), iters=50)
    saved = current_variant()
    set_variant(saved[0], saved[1], saved[2], saved[3], frozenset())  # the same dispatch, every fusion off
    if graphs is not None:
        graphs.invalidate()
    try:
        llm.generate(prompt, greedy, use_tqdm=False)
        res["profiles"]["greedy_unfused"] = profile_generation(llm, prompt, greedy, args.tokens, out,
                                                               "greedy_unfused", layers)
        runner = llm.llm_engine.executor.driver_worker.runner
        res["profiles"]["greedy_unfused"]["graphs"] = runner.cuda_graphs is not None  # False: the capture failed
        runner.cuda_graphs = graphs
    except Exception as e:  # the variants below still run
        res["profiles"]["greedy_unfused"] = dict(error=f"{type(e).__name__}: {e}"[:300])
    set_variant(*saved)
    if graphs is not None:
        res["b1_replay_by_variant"] = replay_by_variant(llm, prompt, rounds=args.rounds)
    (out / "profile_step.json").write_text(json.dumps(res, indent=1))
    print_linear_table(res, shapes, cfg)
    print("| b1 step | wall ms/token | GPU kernel ms/token |\n|---|---|---|")
    for tag, p in res["profiles"].items():
        if "error" in p:
            print(f"| {tag} | {p['error']} | |")
        else:
            eager = " (eager: capture failed)" if p.get("graphs") is False else ""
            print(f"| {tag}{eager} | {p['wall_ms_per_token']:.3f} | {p['gpu_ms_per_token']:.3f} |")
    print(f"batch-1 graph replay alone (environment's dispatch): {res.get('b1_replay_ms', float('nan')):.3f} ms")
    for tag in ("greedy", "greedy_unfused"):
        p = res["profiles"].get(tag, {})
        if "kernels" in p:
            print(f"{tag}: {p['kernels_per_token']:.1f} GPU kernels per token, "
                  f"{p['kernels_per_token'] / cfg.num_hidden_layers:.2f} per layer")
            print("| kernel | per token | per layer | us each | us per token |\n|---|---|---|---|---|")
            for name, per_tok, per_layer, us_each, us_tok in p["kernels"][:20]:
                print(f"| {name} | {per_tok:.2f} | {per_layer:.2f} | {us_each:.2f} | {us_tok:.1f} |")
    if "b1_replay_by_variant" in res:
        print(f"| step variant (GEMV rows; fusions; split grain) | b1 replay ms (median of {args.rounds}) |"
              " all rounds | wall ms/token |\n|---|---|---|---|")
        for tag, r in res["b1_replay_by_variant"].items():
            rounds = " ".join(f"{x:.3f}" for x in r["replay_ms"]) or r.get("error", "-")
            print(f"| {tag} | {r['replay_ms_median']:.3f} | {rounds} | {r['wall_ms_per_token_median']:.3f} |")
    for tag, p in res["profiles"].items():
        if "top_kernels" in p:
            print(tag, "top kernels (us per token):", p["top_kernels"][:8])


def print_linear_table(res: dict, shapes: dict, cfg) -> None:
    """The per-shape table: us and fraction of the copy bandwidth per variant, side by side."""
    per_layer = sum(a * b for name, (a, b) in shapes.items() if name != "lm_head") * 2
    weight_bytes = per_layer * cfg.num_hidden_layers + cfg.hidden_size * cfg.vocab_size * 2
    print(f"| {res['device']} | copy {res['copy_gbs']:.0f} GB/s | linear weights per step {weight_bytes / 1e9:.2f} GB"
          f" | floor {weight_bytes / res['copy_gbs'] / 1e6:.3f} ms |")
    tags = [t for t, *_ in GEMV_VARIANTS]
    print("| linear | M | in x out | " + " | ".join(f"{t} us (of copy)" for t in tags) + " |")
    print("|---|---|---|" + "---|" * len(tags))
    for r in res["linears"]:
        cells = [f"{r[t + '_us']:.1f} ({r[t + '_of_copy']:.2f})" if t + "_us" in r else "failed" for t in tags]
        print(f"| {r['name']} | {r['m']} | {r['n_in']} x {r['n_out']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
