"""Where a batch-1 decode step's time goes on the GPU (issue 21's MBU target), in one process:

1. each linear's shape at M = 1, 4 and 8 through cuBLAS and through every `linear_gemv` variant (GEMV_VARIANTS:
   kernel 1, 2, 3, 4, with and without PDL), captured in a CUDA graph over rotating weight copies (so the 50 MB L2 cache
   does not hold them): achieved GB/s against the copy bandwidth of the same run;
2. the ~1.1B bf16 model of bench_gpu.py under `torch.profiler` for a batch-1 generation with CUDA graphs: wall time
   per token, GPU kernel time per token, and the kernels that take it (the host loop is the difference), under the
   environment's dispatch and again under kernel 2 + PDL;
3. the batch-1 graph replay time under each variant, and under kernel 2 + PDL with other decode split grains
   (PAGELLM_CUDA_DECODE_SPLIT_GRAIN): graphs recaptured per variant, variants interleaved over rounds; medians.

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
# the batch-1 step under each GEMV variant (decode split grain: the kernel's default), then kernel 2 + PDL under
# other PAGELLM_CUDA_DECODE_SPLIT_GRAIN values (the 190-token context: 256 makes one split, no reduction work)
STEP_VARIANTS = [(*v, "") for v in GEMV_VARIANTS] + [
    (f"k2_pdl_grain{g}", 8, 2, True, str(g)) for g in (16, 32, 128, 256)]


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
    are recaptured per variant (linear_dispatch and the split grain are read while capturing); variants
    interleaved in every round."""
    from pagellm import SamplingParams
    from pagellm.ops import linear_dispatch

    runner = llm.llm_engine.executor.driver_worker.runner
    graphs = runner.cuda_graphs
    saved = (linear_dispatch.CUDA_GEMV_MAX_M, linear_dispatch.CUDA_GEMV_KERNEL, linear_dispatch.CUDA_GEMV_PDL)
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    res: dict[str, dict] = {tag: dict(replay_ms=[], wall_ms_per_token=[]) for tag, *_ in STEP_VARIANTS}
    grain_env = os.environ.get("PAGELLM_CUDA_DECODE_SPLIT_GRAIN")
    for _ in range(rounds):
        for tag, max_m, kernel, pdl, grain in STEP_VARIANTS:
            linear_dispatch.CUDA_GEMV_MAX_M, linear_dispatch.CUDA_GEMV_KERNEL = max_m, kernel
            linear_dispatch.CUDA_GEMV_PDL = pdl
            os.environ["PAGELLM_CUDA_DECODE_SPLIT_GRAIN"] = grain or (grain_env or "")
            graphs.invalidate()
            runner.cuda_graphs = graphs  # a failed capture sets it to None: the next variant gets it back
            llm.generate(prompt, sp, use_tqdm=False)  # captures bucket 1 under this variant
            if runner.cuda_graphs is None or 1 not in graphs.captured_buckets:
                res[tag]["error"] = "no batch-1 graph (capture failed: see the log)"
                continue
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompt, sp, use_tqdm=False)
            torch.cuda.synchronize()
            res[tag]["wall_ms_per_token"].append((time.perf_counter() - t0) * 1e3 / tokens)
            res[tag]["replay_ms"].append(cuda_median_ms(lambda: graphs.replay(1), iters=50))
    linear_dispatch.CUDA_GEMV_MAX_M, linear_dispatch.CUDA_GEMV_KERNEL, linear_dispatch.CUDA_GEMV_PDL = saved
    if grain_env is None:
        os.environ.pop("PAGELLM_CUDA_DECODE_SPLIT_GRAIN", None)
    else:
        os.environ["PAGELLM_CUDA_DECODE_SPLIT_GRAIN"] = grain_env
    runner.cuda_graphs = graphs
    graphs.invalidate()
    for r in res.values():
        for k in ("replay_ms", "wall_ms_per_token"):
            r[f"{k}_median"] = statistics.median(r[k]) if r[k] else float("nan")
    return res


def profile_generation(llm, prompt, sp, tokens: int, out: Path, tag: str) -> dict:
    """Wall ms/token, GPU kernel ms/token and the top kernels of one profiled generation."""
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
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    res["gpu_ms_per_token"] = gpu_us / 1e3 / tokens
    res["top_kernels"] = sorted(((e.key[:80], round(e.self_device_time_total / tokens, 1))
                                 for e in events if e.self_device_time_total > 0), key=lambda kv: -kv[1])[:15]
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
    from pagellm.ops import linear_dispatch

    llm = LLM(str(tmp / "llama-1b"), device="cuda", dtype="bfloat16", max_model_len=4096, seed=0,
              kv_cache_memory_gb=16, max_num_seqs=64, enable_prefix_caching=False)
    prompt = [{"prompt_token_ids": list(range(5, 133))}]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.tokens, ignore_eos=True)
    for sp in (greedy, sampled):  # warm-up: graphs captured, sampler kernels loaded
        llm.generate(prompt, sp, use_tqdm=False)
    res["profiles"] = {tag: profile_generation(llm, prompt, sp, args.tokens, out, tag)
                       for tag, sp in (("greedy", greedy), ("sampled", sampled))}
    graphs = llm.llm_engine.executor.driver_worker.runner.cuda_graphs
    if graphs is not None and 1 in graphs.captured_buckets:
        res["b1_replay_ms"] = cuda_median_ms(lambda: graphs.replay(1), iters=50)
    saved = (linear_dispatch.CUDA_GEMV_MAX_M, linear_dispatch.CUDA_GEMV_KERNEL, linear_dispatch.CUDA_GEMV_PDL)
    linear_dispatch.CUDA_GEMV_MAX_M, linear_dispatch.CUDA_GEMV_KERNEL, linear_dispatch.CUDA_GEMV_PDL = 8, 2, True
    if graphs is not None:
        graphs.invalidate()
    try:
        llm.generate(prompt, greedy, use_tqdm=False)
        res["profiles"]["greedy_k2_pdl"] = profile_generation(llm, prompt, greedy, args.tokens, out, "greedy_k2_pdl")
        runner = llm.llm_engine.executor.driver_worker.runner
        res["profiles"]["greedy_k2_pdl"]["graphs"] = runner.cuda_graphs is not None  # False: the capture failed
        runner.cuda_graphs = graphs
    except Exception as e:  # the variants below still run
        res["profiles"]["greedy_k2_pdl"] = dict(error=f"{type(e).__name__}: {e}"[:300])
    linear_dispatch.CUDA_GEMV_MAX_M, linear_dispatch.CUDA_GEMV_KERNEL, linear_dispatch.CUDA_GEMV_PDL = saved
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
    if "b1_replay_by_variant" in res:
        print(f"| step variant (GEMV for M <= 8; split grain) | b1 replay ms (median of {args.rounds}) | all rounds |"
              " wall ms/token |\n|---|---|---|---|")
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
