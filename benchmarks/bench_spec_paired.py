#!/usr/bin/env python
"""Batch-1 decode CPU time per token of speculative configs against no speculation, paired prompt by prompt (issue 17).

    PAGELLM_NUM_THREADS=1 python benchmarks/bench_spec_paired.py --medusa-heads /work/medusa-s16 --trees 3,4 --chain
    PAGELLM_NUM_THREADS=1 python benchmarks/bench_spec_paired.py --medusa-heads DIR --pagellm-src /tmp/before/python

On a loaded shared machine bench_spec_decode's per-round ratios swing by +-10 %: its engines each run a whole
workload in turn while the load moves. Here every engine (none first) answers the same chat prompt before the next
prompt starts, and each answer's decode cost is this thread's CPU time (time.thread_time; with PAGELLM_NUM_THREADS=1
the kernels run on it) of the whole answer less that of its prefill + first token, per decode token. Reported: mean
ms per token, the ratio of the means to none's, the median of the per-prompt ratios, and each method's mean accepted
length. Default model bf16, greedy, EOS ignored; the adaptive switch on (speculative_config defaults).
Writes benchmarks/results/spec_paired_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import bench_spec_decode as S
import bench_step_profile as P
import common as C
import spec_workloads as W


def configs(args) -> dict[str, dict | None]:
    medusa = {"method": "medusa", "num_speculative_tokens": 3, "model": args.medusa_heads}
    out: dict[str, dict | None] = {"none": None}
    if args.chain:
        out["chain of 3"] = medusa
    for n in args.trees:
        out[f"tree heads:{n}"] = {**medusa, "tree": f"heads:{n}"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--medusa-heads", required=True)
    ap.add_argument("--trees", type=lambda s: [int(x) for x in s.split(",") if x], default=[4],
                    help="fitted tree sizes to serve (\"tree\": \"heads:N\"), '' for none")
    ap.add_argument("--chain", action="store_true", help="also the heads' chain of 3")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tag", default="medusa")
    ap.add_argument("--pagellm-src", default=None, help="import pagellm from this python/ dir (a 'before' build)")
    args = ap.parse_args()
    if args.pagellm_src:
        P.use_pagellm_from(args.pagellm_src)
    from pagellm import SamplingParams

    tok, _ = C.load_tokenizer_for_prompts()
    prompts = W.workloads(tok, args.num_prompts, args.output_len, names=("chat",))["chat"]
    llms = {name: C.make_llm("default", max_model_len=max(len(p.token_ids) for p in prompts) + args.output_len + 16,
                             max_num_seqs=1, kv_gb=0.5, speculative_config=spec) for name, spec in configs(args).items()}
    for llm in llms.values():  # warm-up: step graphs captured
        S.run_batches(llm, prompts[-1:], 1, args.output_len)
    answer = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    ms: dict[str, list[float]] = {name: [] for name in llms}
    spec_rows: dict[str, list[tuple[int, int]]] = {name: [] for name in llms}
    load_start = C.loadavg()
    for _ in range(args.rounds):
        for p in prompts:
            for name, llm in llms.items():
                req = [{"prompt_token_ids": p.token_ids}]
                llm.reset_prefix_cache()
                t0 = time.thread_time()
                llm.generate(req, first, use_tqdm=False)
                t1 = time.thread_time()
                llm.reset_prefix_cache()
                out = llm.generate(req, answer, use_tqdm=False)[0]
                t2 = time.thread_time()
                ms[name].append(((t2 - t1) - (t1 - t0)) / (len(out.outputs[0].token_ids) - 1) * 1e3)
                m = out.metrics.spec_decode
                if m is not None:
                    spec_rows[name].append((m.num_spec_rows, m.num_accepted_draft_tokens))
    base = ms["none"]
    rows, results = [], []
    for name, xs in ms.items():
        rows_, acc = (sum(r for r, _ in spec_rows[name]), sum(a for _, a in spec_rows[name]))
        res = {"name": name, "ms_per_token": statistics.fmean(xs), "ratio": statistics.fmean(base) / statistics.fmean(xs),
               "median_paired_ratio": statistics.median(b / x for b, x in zip(base, xs)),
               "mean_accepted_len": 1 + acc / rows_ if rows_ else None, "ms": xs}
        results.append(res)
        rows.append([name, f"{res['ms_per_token']:.2f}", f"{res['ratio']:.2f}x", f"{res['median_paired_ratio']:.2f}x",
                     "-" if res["mean_accepted_len"] is None else f"{res['mean_accepted_len']:.2f}"])
    data = {"tag": args.tag, "env": C.env_info(), "args": vars(args), "load_start": load_start,
            "load_end": C.loadavg(), "results": results}
    md = "\n".join([f"# Paired batch-1 chat decode, CPU time per token ({args.tag})", "",
                    f"{data['env']['cpu']}, git {data['env']['git_head']}, load {load_start[0]:.2f} -> "
                    f"{data['load_end'][0]:.2f}; heads {args.medusa_heads}; {args.num_prompts} chat prompts x "
                    f"{args.rounds} rounds, {args.output_len} new tokens, engines in turn per prompt.", "",
                    C.md_table(["method", "decode ms / token (thread CPU)", "vs none (means)",
                                "vs none (median per prompt)", "mean accepted len"], rows)])
    print("\n" + md, flush=True)
    C.save_results(f"spec_paired_{args.tag}", md, data)


if __name__ == "__main__":
    main()
