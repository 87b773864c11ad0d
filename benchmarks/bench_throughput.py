#!/usr/bin/env python
"""Offline throughput: pagellm `LLM.generate` vs HF transformers `generate` (batched, left-padded),
same weights, bf16, greedy, forced output lengths; plus a throughput-vs-concurrency sweep.

    python benchmarks/bench_throughput.py                       # 256 requests, both models, HF on 32
    python benchmarks/bench_throughput.py --quick               # smoke run (minutes)
    python benchmarks/bench_throughput.py --models smollm2-135m --num-requests 128 --hf-requests 16

Requests: prompts of U[64, 512] tokens cut from Debian's python3.11-doc reST sources (tokenized with
the default model's tokenizer, whose ids are valid for both models), outputs of U[64, 256] tokens
with ignore_eos. HF runs on an evenly spread subset (--hf-requests) of the same request list,
in chunks of --hf-batch-size sorted by output length; its "output tok/s" counts the requested
tokens only (what a user gets; padding steps of shorter rows are waste of static batching).
Writes benchmarks/results/throughput_<tag>.{md,json} and docs/throughput_vs_concurrency.png.
"""

from __future__ import annotations

import argparse
import gc
import time

import common as C
import torch


def run_pagellm(llm, reqs: list[C.Request]) -> dict:
    from pagellm import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0, detokenize=False) for r in reqs]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    el = time.perf_counter() - t
    in_toks = sum(len(r.prompt_token_ids) for r in reqs)
    out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
    want = sum(r.output_len for r in reqs)
    assert out_toks == want, f"pagellm produced {out_toks} tokens, expected {want}"
    return {"num_requests": len(reqs), "elapsed_s": el, "input_tokens": in_toks, "output_tokens": out_toks,
            "input_tok_s": in_toks / el, "output_tok_s": out_toks / el, "total_tok_s": (in_toks + out_toks) / el,
            "req_s": len(reqs) / el}


def warmup_pagellm(llm, pool) -> None:
    from pagellm import SamplingParams

    llm.generate([{"prompt_token_ids": pool[:96]}, {"prompt_token_ids": pool[200:300]}],
                 SamplingParams(max_tokens=8, ignore_eos=True, temperature=0, detokenize=False), use_tqdm=False)


def bench_model(name: str, args, pool) -> dict:
    print(f"\n=== {name} ===", flush=True)
    reqs = C.make_requests(pool, args.num_requests, tuple(args.input_len), tuple(args.output_len), seed=args.seed)
    max_len = args.input_len[1] + args.output_len[1] + 16
    t = time.perf_counter()
    llm = C.make_llm(name, max_model_len=max_len, max_num_seqs=args.max_num_seqs, kv_gb=args.kv_cache_gb,
                     max_num_batched_tokens=args.max_num_batched_tokens)
    load_s = time.perf_counter() - t
    eng = llm.llm_engine
    hf_path = eng.model_files.path
    info = C.model_bytes_per_decode_token(eng.model, eng.model_files.hf_config)
    warmup_pagellm(llm, pool)
    res: dict = {"model": name, "path": str(hf_path), "num_params": info["num_params"], "load_s": load_s,
                 "attention_backend": type(eng.attn_backend).__name__, "num_kv_blocks": eng.num_blocks}
    la0 = C.loadavg()
    print(f"[pagellm] {len(reqs)} requests ...", flush=True)
    res["pagellm"] = p = run_pagellm(llm, reqs)
    p["loadavg_before"], p["loadavg_after"] = la0, C.loadavg()
    hf_config = eng.model_files.hf_config
    def add_mfu(r: dict, rs) -> None:  # FLOPs now; MFU at the end, against the best ceiling sample of the run
        r["flops"] = C.model_flops(hf_config, [(len(x.prompt_token_ids), x.output_len) for x in rs])
        args.gemm_samples.append(C.bf16_matmul_gflops()["best_gflops"])

    add_mfu(p, reqs)
    print(f"[pagellm] {p['elapsed_s']:.1f}s  in {p['input_tok_s']:.1f} tok/s  out {p['output_tok_s']:.1f} tok/s",
          flush=True)
    sub = C.stratified_subset(reqs, args.hf_requests)
    if args.no_hf:
        return res
    # HF and pagellm on the same subset, interleaved: this machine's matmul speed swings by 2x within
    # seconds (a shared AMX unit), so each repeat pairs runs taken minutes apart at most.
    hf = C.load_hf(hf_path)
    C.hf_generate_batch(hf, [pool[:32], pool[40:60]], 4)  # warmup
    pairs = []
    for r in range(args.repeats):
        ps = run_pagellm(llm, sub)
        add_mfu(ps, sub)
        la0 = C.loadavg()
        h = C.hf_throughput(hf, sub, args.hf_batch_size)
        h["loadavg_before"], h["loadavg_after"] = la0, C.loadavg()
        add_mfu(h, sub)  # useful FLOPs only (padding rows not counted)
        pairs.append((ps, h))
        print(f"[repeat {r + 1}/{args.repeats}] {len(sub)} requests: pagellm out {ps['output_tok_s']:.1f} tok/s, "
              f"HF (batch {args.hf_batch_size}) out {h['output_tok_s']:.1f} tok/s (generated incl. padding rows "
              f"{h['generated_tok_s']:.1f}): {ps['output_tok_s'] / h['output_tok_s']:.2f}x", flush=True)
    del hf
    gc.collect()
    ratios = [ps["output_tok_s"] / h["output_tok_s"] for ps, h in pairs]
    mid = sorted(range(len(pairs)), key=lambda i: ratios[i])[len(pairs) // 2]  # the median pair
    res["pagellm_subset"], res["hf"] = pairs[mid]
    res["subset_repeats"] = [{"pagellm_output_tok_s": ps["output_tok_s"], "hf_output_tok_s": h["output_tok_s"],
                              "ratio": q} for (ps, h), q in zip(pairs, ratios)]
    hf_out = sorted(h["output_tok_s"] for _, h in pairs)[len(pairs) // 2]
    hf_tot = sorted(h["total_tok_s"] for _, h in pairs)[len(pairs) // 2]
    res["ratio_output_tok_s"] = p["output_tok_s"] / hf_out
    res["ratio_total_tok_s"] = p["total_tok_s"] / hf_tot
    res["ratio_output_tok_s_same_subset"] = ratios[mid]
    return res


def concurrency_sweep(args, pool) -> dict:
    name = args.concurrency_model
    reqs = C.make_requests(pool, args.concurrency_requests, tuple(args.concurrency_input_len),
                           tuple(args.concurrency_output_len), seed=args.seed + 1)
    max_len = args.concurrency_input_len[1] + args.concurrency_output_len[1] + 16
    rows = []
    for c in args.concurrency:
        llm = C.make_llm(name, max_model_len=max_len, max_num_seqs=c, kv_gb=args.kv_cache_gb,
                         max_num_batched_tokens=args.max_num_batched_tokens)
        warmup_pagellm(llm, pool)
        la0 = C.loadavg()
        r = run_pagellm(llm, reqs)
        r["max_num_seqs"], r["loadavg_before"], r["loadavg_after"] = c, la0, C.loadavg()
        rows.append(r)
        print(f"[concurrency {c:>3}] {r['elapsed_s']:.1f}s  out {r['output_tok_s']:.1f} tok/s  "
              f"total {r['total_tok_s']:.1f} tok/s", flush=True)
        del llm
        gc.collect()
    return {"model": name, "num_requests": len(reqs), "input_len": args.concurrency_input_len,
            "output_len": args.concurrency_output_len, "rows": rows}


def plot_concurrency(sweep: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["max_num_seqs"] for r in sweep["rows"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(xs, [r["output_tok_s"] for r in sweep["rows"]], "o-", label="output tok/s")
    ax.plot(xs, [r["total_tok_s"] for r in sweep["rows"]], "s--", label="input+output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("max_num_seqs")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"pagellm offline throughput vs concurrency\n{sweep['model']} bf16, {sweep['num_requests']} requests "
                 f"(in {sweep['input_len'][0]}-{sweep['input_len'][1]}, out {sweep['output_len'][0]}-"
                 f"{sweep['output_len'][1]} tok), {torch.get_num_threads()} threads", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"[saved] {path}", flush=True)


def render(data: dict) -> str:
    e = data["env"]
    out = [f"# Offline throughput ({data['tag']})", "",
           f"{e['time']}, {e['cpu']}, {e['nproc']} cores, torch {e['torch']} ({e['torch_threads']} threads), "
           f"transformers {e['transformers']}, git {e['git_head']}. Load average before measuring: "
           f"{tuple(round(x, 2) for x in data['load']['load_at_start'])} (waited {data['load']['waited_s']} s, "
           f"below threshold: {data['load']['load_ok']}).", "",
           f"Requests: {data['args']['num_requests']}, prompts U{data['args']['input_len']} tokens from python3.11-doc, "
           f"outputs U{data['args']['output_len']} tokens, ignore_eos, greedy, bf16. HF: "
           f"{data['args']['hf_requests']} evenly spread requests of the same list, left-padded batches of "
           f"{data['args']['hf_batch_size']} sorted by output length; HF output tok/s counts requested tokens only.", ""]
    rows = []
    for m in data["models"]:
        p = m["pagellm"]
        mfu = lambda r: f"{r['mfu']:.2f}" if "mfu" in r else ""  # noqa: E731
        rows.append([m["model"], "pagellm", p["num_requests"], round(p["elapsed_s"], 1), p["input_tok_s"],
                     p["output_tok_s"], p["total_tok_s"], mfu(p), "", ""])
        if "pagellm_subset" in m:
            s = m["pagellm_subset"]
            rows.append([m["model"], "pagellm (HF's subset)", s["num_requests"], round(s["elapsed_s"], 1),
                         s["input_tok_s"], s["output_tok_s"], s["total_tok_s"], mfu(s), "", ""])
        if "hf" in m:
            h = m["hf"]
            rows.append([m["model"], f"HF generate (bs {h['batch_size']})", h["num_requests"], round(h["elapsed_s"], 1),
                         h["input_tok_s"], h["output_tok_s"], h["total_tok_s"], mfu(h),
                         f"{m['ratio_output_tok_s']:.2f}x", f"{m.get('ratio_output_tok_s_same_subset', float('nan')):.2f}x"])
    for m in data["models"]:
        if m.get("subset_repeats"):
            out.append(f"{m['model']}: pagellm / HF on the same {m['hf']['num_requests']} requests, interleaved repeats "
                       "(the median is in the table): " + ", ".join(
                           f"{r['pagellm_output_tok_s']:.1f} / {r['hf_output_tok_s']:.1f} = {r['ratio']:.2f}x"
                           for r in m["subset_repeats"]) + ". HF's median output tok/s is the full run's divisor.")
            out.append("")
    if "gemm_ceiling" in data:
        g = data["gemm_ceiling"]
        out += [f"MFU = useful FLOPs (linear layers for every token, LM head per generated token, causal attention) / "
                f"time / the bf16 matmul ceiling measured in this run ([{g['n']}]^2 torch.mm, best of "
                f"{len(g.get('samples_gflops', [1]))} samples taken after each run: {g['best_gflops']:.0f} GFLOP/s; "
                f"samples {', '.join(f'{x:.0f}' for x in g.get('samples_gflops', []))}).", ""]
    out.append(C.md_table(["model", "engine", "requests", "time s", "input tok/s", "output tok/s", "total tok/s", "MFU",
                           "pagellm/HF output (full run vs HF subset)", "pagellm/HF output (same subset)"], rows))
    for m in data["models"]:
        if "hf" in m and "ratio_total_tok_s" in m:
            p, h = m["pagellm"], m["hf"]
            out += ["", f"{m['model']}: output tokens per prompt token {p['output_tokens'] / p['input_tokens']:.2f} "
                        f"over all {p['num_requests']} requests, {h['output_tokens'] / h['input_tokens']:.2f} over HF's "
                        f"subset, so the full-run output ratio compares different mixes; in total (prompt + output) "
                        f"tok/s the full run is {m['ratio_total_tok_s']:.2f}x HF's subset."]
    if data.get("concurrency"):
        s = data["concurrency"]
        out += ["", f"## Throughput vs concurrency ({s['model']}, {s['num_requests']} requests, in "
                    f"U{s['input_len']}, out U{s['output_len']})", "",
                C.md_table(["max_num_seqs", "time s", "input tok/s", "output tok/s", "total tok/s", "req/s"],
                           [[r["max_num_seqs"], round(r["elapsed_s"], 1), r["input_tok_s"], r["output_tok_s"],
                             r["total_tok_s"], r["req_s"]] for r in s["rows"]]),
                "", "Plot: docs/throughput_vs_concurrency.png. Settings above the request count run the same batch "
                    "(every request admitted at once); their spread shows the run-to-run noise."]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-0.5b-random"],
                    help="smollm2-135m (default model), llama-0.5b-random, or an HF dir")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, nargs=2, default=[64, 512])
    ap.add_argument("--output-len", type=int, nargs=2, default=[64, 256])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    ap.add_argument("--hf-requests", type=int, default=32)
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved pagellm / HF runs on the HF subset; the median pair is reported")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--concurrency-model", default="smollm2-135m")
    ap.add_argument("--concurrency-requests", type=int, default=32)
    ap.add_argument("--concurrency-input-len", type=int, nargs=2, default=[64, 256])
    ap.add_argument("--concurrency-output-len", type=int, nargs=2, default=[16, 48])
    ap.add_argument("--no-concurrency", action="store_true")
    ap.add_argument("--plot", default=str(C.REPO / "docs" / "throughput_vs_concurrency.png"))
    ap.add_argument("--threads", default="auto",
                    help="torch threads; auto: torch's default if the load wait succeeded, else 1")
    ap.add_argument("--wait-load", type=float, default=2.5, help="wait until the 1-min load is below this (0: no)")
    ap.add_argument("--wait-timeout", type=float, default=900)
    ap.add_argument("--quick", action="store_true", help="small smoke run: 32 requests, HF on 8, sweep 1/4/16")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--render", metavar="JSON", help="re-render a saved result JSON to Markdown and exit")
    args = ap.parse_args()
    if args.render:
        import json

        data = json.load(open(args.render))
        md = render(data)
        print(md)
        C.save_results(f"throughput_{data['tag']}", md, data)
        return
    if args.quick:
        args.num_requests, args.hf_requests, args.hf_batch_size, args.repeats = 32, 8, 8, 1
        args.concurrency, args.concurrency_requests = [1, 4, 16], 16
        args.output_len = [16, 64]
        args.concurrency_output_len = [16, 32]
    tag = args.tag or ("quick" if args.quick else "full")
    tok, _ = C.load_tokenizer_for_prompts()
    pool = C.doc_token_pool(tok)
    print(f"[prompts] {len(pool)} doc tokens from {len(C.find_doc_files())} python3.11-doc files", flush=True)
    for m in args.models:  # build models before waiting for the machine to calm down
        C.model_path(m)
    load = C.wait_for_load(args.wait_load, args.wait_timeout) if args.wait_load > 0 else {
        "waited_s": 0, "load_ok": None, "load_at_start": C.loadavg()}
    C.setup_threads(1 if args.threads == "auto" and not load["load_ok"] else
                    (None if args.threads == "auto" else int(args.threads)))
    bw = C.copy_bandwidth_gbs()
    data = {"tag": tag, "env": C.env_info(), "load": load, "copy_bandwidth": bw, "args": vars(args), "models": []}
    print(f"[bandwidth] copy_ {bw['best_gbs']:.1f} GB/s (read+write, best), median {bw['median_gbs']:.1f}", flush=True)
    data["gemm_ceiling"] = gemm = C.bf16_matmul_gflops()
    args.gemm_samples = [gemm["best_gflops"]]
    print(f"[ceiling] bf16 matmul {gemm['best_gflops']:.0f} GFLOP/s (best), median {gemm['median_gflops']:.0f}",
          flush=True)
    for m in args.models:
        data["models"].append(bench_model(m, args, pool))
    # The ceiling swings with the machine (a shared AMX unit): sampled after every run, MFU uses the best.
    gemm["samples_gflops"], gemm["best_gflops"] = args.gemm_samples, max(args.gemm_samples)
    for m in data["models"]:
        for key in ("pagellm", "pagellm_subset", "hf"):
            if key in m and "flops" in m[key]:
                m[key]["mfu"] = m[key]["flops"] / m[key]["elapsed_s"] / 1e9 / gemm["best_gflops"]
    if not args.no_concurrency:
        data["concurrency"] = concurrency_sweep(args, pool)
        plot_concurrency(data["concurrency"], C.Path(args.plot))
    data["load_at_end"] = C.loadavg()
    md = render(data)
    print("\n" + md, flush=True)
    C.save_results(f"throughput_{tag}", md, data)


if __name__ == "__main__":
    main()
