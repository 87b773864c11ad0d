"""Where a batch-1 decode step's time goes on the GPU (issue 21's MBU target), in one process:

1. the ~1.1B bf16 model of bench_gpu.py under `torch.profiler` for a batch-1 generation with CUDA graphs: wall time
   per token, GPU kernel time per token, and the kernels that take it (the host loop is the difference);
2. each linear's shape at M = 1 and 8 through cuBLAS and through linear_small_m's GEMV, captured in a CUDA graph over rotating weight copies
   (so the 50 MB L2 cache does not hold them): achieved GB/s against the copy bandwidth of the same run.

Prints tables last; writes profile_step.json and the profiler table under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import pagellm.ops  # noqa: F401  (registers torch.ops.pagellm, linear_small_m among them)

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu import ceilings, cuda_median_ms, make_model  # noqa: E402


def linear_rates(shapes: dict[str, tuple[int, int]], copy_gbs: float, m: int = 1) -> list[dict]:
    rows = []
    for name, (n_in, n_out) in shapes.items():
        copies = max(2, int(200e6 // (n_in * n_out * 2)))  # >= 200 MB of weights per pass: past the L2 cache
        ws = [torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n_out, device="cuda", dtype=torch.bfloat16)
        row = dict(name=name, n_in=n_in, n_out=n_out, m=m)
        for tag, fn in (("cublas", lambda w: torch.matmul(x, w.t(), out=out)),
                        ("gemv", lambda w: torch.ops.pagellm.linear_small_m(out, x, w, None))):
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
        rows.append(row)
        del ws
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gpu-out")
    ap.add_argument("--tokens", type=int, default=64)
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
    res["linears_m1"] = linear_rates(shapes, res["copy_gbs"], 1)
    res["linears_m8"] = linear_rates(shapes, res["copy_gbs"], 8)

    from torch.profiler import ProfilerActivity, profile

    from pagellm import LLM, SamplingParams

    llm = LLM(str(tmp / "llama-1b"), device="cuda", dtype="bfloat16", max_model_len=4096, seed=0,
              kv_cache_memory_gb=16, max_num_seqs=64, enable_prefix_caching=False)
    prompt = [{"prompt_token_ids": list(range(5, 133))}]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.tokens, ignore_eos=True)
    for sp in (greedy, sampled):  # warm-up: graphs captured, sampler kernels loaded
        llm.generate(prompt, sp, use_tqdm=False)
    for tag, sp in (("greedy", greedy), ("sampled", sampled)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        torch.cuda.synchronize()
        res[f"{tag}_wall_ms_per_token"] = (time.perf_counter() - t0) * 1e3 / args.tokens
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompt, sp, use_tqdm=False)
            torch.cuda.synchronize()
        events = prof.key_averages()
        table = events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70)
        (out / f"profile_{tag}.txt").write_text(table)
        gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        res[f"{tag}_gpu_ms_per_token"] = gpu_us / 1e3 / args.tokens
        res[f"{tag}_top_kernels"] = sorted(((e.key[:80], round(e.self_device_time_total / args.tokens, 1))
                                            for e in events if e.self_device_time_total > 0),
                                           key=lambda kv: -kv[1])[:15]
        print(tag, "profiler table:\n" + table, flush=True)
    graphs = llm.llm_engine.executor.driver_worker.runner.cuda_graphs
    if graphs is not None and 1 in graphs.captured_buckets:
        res["b1_replay_ms"] = cuda_median_ms(lambda: graphs.replay(1), iters=50)
    (out / "profile_step.json").write_text(json.dumps(res, indent=1))
    per_layer = sum(a * b for name, (a, b) in shapes.items() if name != "lm_head") * 2
    weight_bytes = per_layer * cfg.num_hidden_layers + h * v * 2
    print(f"| {res['device']} | copy {res['copy_gbs']:.0f} GB/s | linear weights per step {weight_bytes / 1e9:.2f} GB"
          f" | floor {weight_bytes / res['copy_gbs'] / 1e6:.3f} ms |")
    print("| linear | M | in x out | cuBLAS us | of copy | GEMV us | of copy |\n|---|---|---|---|---|---|---|")
    for r in res["linears_m1"] + res["linears_m8"]:
        print(f"| {r['name']} | {r['m']} | {r['n_in']} x {r['n_out']} | {r['cublas_us']:.1f} | "
              f"{r['cublas_of_copy']:.2f} | {r['gemv_us']:.1f} | {r['gemv_of_copy']:.2f} |")
    print("| b1 step | wall ms/token | GPU kernel ms/token | graph replay alone ms |\n|---|---|---|---|")
    for tag in ("greedy", "sampled"):
        print(f"| {tag} | {res[f'{tag}_wall_ms_per_token']:.3f} | {res[f'{tag}_gpu_ms_per_token']:.3f} | "
              f"{res.get('b1_replay_ms', float('nan')):.3f} |")
    for tag in ("greedy", "sampled"):
        print(tag, "top kernels (us per token):", res[f"{tag}_top_kernels"][:8])


if __name__ == "__main__":
    main()
