"""The GPU benchmark of issue 21, in one process: ceilings measured in the same run (device copy bandwidth,
bf16 matrix rate), then a ~1.1B random Llama-shaped model in bf16 (hidden 2048, 16 layers, 32 heads / 8 KV heads,
MLP 8192, vocabulary 32000) on device="cuda": batch-1 decode TPOT and its MBU, batch-64 decode throughput,
batch-1 prefill of 2048 tokens and its MFU; the same model in HF transformers (eager PyTorch, SDPA attention)
as the baseline; decode linears through the default dispatch (`linear_dispatch`: `linear_gemv` kernel 4 + PDL at
M = 1) and through another (`graphs_alt`: rows up to --gemv-max-m on --gemv-kernel / --gemv-pdl; by default
--gemv-max-m 0, cuBLAS everywhere). Medians of repeated runs. Prints a table; writes bench_gpu.json under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def cuda_median_ms(fn, iters: int = 10, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def ceilings() -> dict:
    n = 1 << 30  # 2 GiB of bf16 each way
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = cuda_median_ms(lambda: dst.copy_(src), iters=20)
    copy_gbs = 2 * src.numel() * 2 / ms / 1e6
    del src, dst
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = cuda_median_ms(lambda: a @ b, iters=10)
    return dict(copy_gbs=copy_gbs, bf16_tflops=2 * m**3 / ms / 1e9)


def make_model(path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    return model, cfg


def timed(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gpu-out")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gemv-kernel", type=int, default=1, choices=(1, 2, 3, 4), help="graphs_alt: linear_gemv kernel")
    ap.add_argument("--gemv-pdl", type=int, default=0, choices=(0, 1), help="graphs_alt's GEMVs as PDL dependents")
    ap.add_argument("--gemv-max-m", type=int, default=0, help="graphs_alt: rows up to this take the GEMV (0: cuBLAS)")
    args = ap.parse_args()
    res = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__)
    res.update(ceilings())
    print("ceilings", res, flush=True)
    tmp = Path(tempfile.mkdtemp())
    hf, cfg = make_model(tmp / "llama-1b")
    n_params = sum(p.numel() for p in hf.parameters())
    emb = cfg.vocab_size * cfg.hidden_size
    weight_bytes = (n_params - emb) * 2  # a decode step reads every weight but the embedding table
    res.update(params=n_params, weight_bytes_per_step=weight_bytes)
    new, rep = args.new_tokens, args.repeats
    g = torch.Generator().manual_seed(0)
    p128 = [torch.randint(5, cfg.vocab_size, (128,), generator=g).tolist() for _ in range(64)]
    p2k = torch.randint(5, cfg.vocab_size, (2048,), generator=g).tolist()
    flops_prefill = 2 * (n_params - emb) * 2048 + 2 * 2 * cfg.num_hidden_layers * cfg.hidden_size * 2048 * 2048 / 2

    # HF eager baseline (SDPA attention), batch 1.
    with torch.no_grad():
        ids = torch.tensor([p128[0]], device="cuda")

        def hf_gen(n):
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        hf_gen(4)
        t_full, t_one = timed(lambda: hf_gen(new), rep), timed(lambda: hf_gen(1), rep)
        res["hf_b1_tpot_ms"] = (t_full - t_one) / (new - 1) * 1e3
        res["hf_prefill_2k_ms"] = timed(lambda: hf(torch.tensor([p2k], device="cuda")), rep) * 1e3
    del hf
    torch.cuda.empty_cache()
    print("hf", {k: v for k, v in res.items() if k.startswith("hf")}, flush=True)

    from pagellm import LLM, SamplingParams
    from pagellm.ops import linear_dispatch

    default = (linear_dispatch.CUDA_GEMV_MAX_M, linear_dispatch.CUDA_GEMV_KERNEL, linear_dispatch.CUDA_GEMV_PDL)
    gemv = (args.gemv_max_m, args.gemv_kernel, bool(args.gemv_pdl))
    res["gemv_config"] = dict(max_m=gemv[0], kernel=gemv[1], pdl=gemv[2], default=default)
    # graphs twice, around graphs_alt: the spread between its two runs shows what the order alone does
    for tag, eager, dispatch in (("graphs", False, default), ("graphs_alt", False, gemv),
                                 ("graphs_again", False, default), ("eager", True, default)):
        # decode linears of up to max_m rows: pagellm's GEMV (this kernel, PDL or not), the others cuBLAS
        linear_dispatch.CUDA_GEMV_MAX_M, linear_dispatch.CUDA_GEMV_KERNEL, linear_dispatch.CUDA_GEMV_PDL = dispatch
        try:
            llm = LLM(str(tmp / "llama-1b"), device="cuda", dtype="bfloat16", max_model_len=4096, seed=0,
                      enforce_eager=eager, kv_cache_memory_gb=16, max_num_seqs=64, enable_prefix_caching=False)

            def gen(prompts, n):
                sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            gen(p128[:2], 8)
            t_full, t_one = timed(lambda: gen(p128[:1], new), rep), timed(lambda: gen(p128[:1], 1), rep)
            tpot = (t_full - t_one) / (new - 1)
            res[f"{tag}_b1_tpot_ms"] = tpot * 1e3
            res[f"{tag}_b1_mbu"] = weight_bytes / tpot / (res["copy_gbs"] * 1e9)
            graphs = llm.llm_engine.executor.driver_worker.runner.cuda_graphs
            if graphs is not None and 1 in graphs.captured_buckets:  # the step's GPU time alone, host loop aside
                res[f"{tag}_b1_replay_ms"] = cuda_median_ms(lambda: graphs.replay(1), iters=50)
                res[f"{tag}_b1_replay_mbu"] = weight_bytes / (res[f"{tag}_b1_replay_ms"] / 1e3) / (res["copy_gbs"] * 1e9)
            t64_full, t64_one = timed(lambda: gen(p128, new), rep), timed(lambda: gen(p128, 1), rep)
            res[f"{tag}_b64_tpot_ms"] = (t64_full - t64_one) / (new - 1) * 1e3
            res[f"{tag}_b64_tok_s"] = 64 * new / t64_full
            t_pf = timed(lambda: gen([p2k], 1), rep)
            res[f"{tag}_prefill_2k_ms"] = t_pf * 1e3
            res[f"{tag}_prefill_mfu"] = flops_prefill / t_pf / (res["bf16_tflops"] * 1e12)
            del llm
        except Exception as e:
            import traceback

            traceback.print_exc()
            res[f"{tag}_error"] = f"{type(e).__name__}: {e}"[:300]
        torch.cuda.empty_cache()
        print(tag, {k: v for k, v in res.items() if k.startswith(tag)}, flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_gpu.json").write_text(json.dumps(res, indent=1))
    print(f"| {res['device']} | copy {res['copy_gbs']:.0f} GB/s | bf16 {res['bf16_tflops']:.0f} TFLOP/s |"
          f" graphs_alt: M <= {gemv[0]} on linear_gemv kernel {gemv[1]}, PDL {'on' if gemv[2] else 'off'};"
          f" the others: (max_m, kernel, pdl) = {default} |")
    print("| path | b1 TPOT ms | b1 MBU | b64 TPOT ms | b64 tok/s | prefill 2k ms | prefill MFU |")
    print("|---|---|---|---|---|---|---|")
    for tag in ("graphs", "graphs_alt", "graphs_again", "eager"):
        f = lambda k, fmt="{:.2f}": fmt.format(res[k]) if k in res else "-"  # noqa: E731
        print(f"| pagellm {tag} | {f(tag + '_b1_tpot_ms')} | {f(tag + '_b1_mbu')} | {f(tag + '_b64_tpot_ms')} | "
              f"{f(tag + '_b64_tok_s', '{:.0f}')} | {f(tag + '_prefill_2k_ms')} | {f(tag + '_prefill_mfu')} |")
    for tag in ("graphs", "graphs_alt", "graphs_again"):
        if f"{tag}_b1_replay_ms" in res:
            print(f"| {tag}: batch-1 graph replay alone | {res[f'{tag}_b1_replay_ms']:.3f} | "
                  f"{res[f'{tag}_b1_replay_mbu']:.2f} | - | - | - | - |")
    print(f"| HF eager (SDPA) | {res['hf_b1_tpot_ms']:.2f} | {weight_bytes / res['hf_b1_tpot_ms'] * 1e3 / (res['copy_gbs'] * 1e9):.2f}"
          f" | - | - | {res['hf_prefill_2k_ms']:.2f} | "
          f"{flops_prefill / (res['hf_prefill_2k_ms'] / 1e3) / (res['bf16_tflops'] * 1e12):.2f} |")


if __name__ == "__main__":
    main()
