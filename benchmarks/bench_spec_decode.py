#!/usr/bin/env python
"""Speculative decoding on the default model (SmolLM2-135M-Instruct): decode speed and acceptance per
method and number of draft tokens k, against no speculation, in one interleaved run.

    python benchmarks/bench_spec_decode.py                                # none + ngram k=2,4; batch 1 and 8
    python benchmarks/bench_spec_decode.py --methods none,ngram --ks 3 --batches 1 --rounds 1 --output-len 16
    python benchmarks/bench_spec_decode.py --methods none,medusa,medusa_tree --ks 3 --workloads chat --medusa-heads DIR
    python benchmarks/bench_spec_decode.py --methods none,ngram,ngram_tree --ks 3,6 --tree-nodes 8 --batches 1

Workloads (chat-templated, greedy; spec_workloads.py says what each asks and where its text comes from):
  copy    issue 17's copy-heavy tasks: rewrite a KJV passage, proofread a paragraph of the Python docs, add type hints
          to a standard-library function; each answer is the whole passage / function, so max_tokens covers it
          (1.3x the passage + 48) and generation stops at EOS (session 15 on; "tokens" below are the model's own)
  copy14  session 14's copy prompts with --output-len new tokens, EOS ignored (the old workload, for comparison)
  chat    open questions (little to copy), --output-len new tokens, EOS ignored
Batch b: the workload's prompts are submitted b at a time (LLM.generate of b prompts, max_num_seqs b).
Each round runs every (workload, batch, method, k) once, engines in turn; medians over rounds of
tokens/s (new tokens / wall time of the batch), TPOT (median over the requests of RequestMetrics.tpot),
the ratio of tokens/s to no speculation in the same round (also per CPU second of this process: on a loaded
machine with PAGELLM_NUM_THREADS=1 that leaves out the time spent waiting for a core; with `--decode-cpu`, decode
tokens per CPU second: each batch's prefill + first token is run alone first and its CPU time taken off), and from
RequestMetrics.spec_decode the acceptance rate and mean accepted length (tokens per spec step, the target's own
included), and "c measured": the switch's draft token cost at the end of the run (SpecSwitch.draft_token_cost: a draft
token's verify time over a row's share of a plain step; what draft_length "cost" sizes drafts by). By default each sequence drafts only while its acceptance pays for the verify cost measured at the step's
batch size (the adaptive switch, spec_decode/switch.py; `ngram_adaptive_k` also picks how many drafts <= k;
the proposer's batch limit still applies: ngram / draft_model off above 4 sequences); `--adaptive off` drafts for
every sequence below each method's default limit (off above 4 sequences), `--disable-by-batch-size N`
sets the limit. Kernel threads come from PAGELLM_NUM_THREADS (the engine's own setting).
Writes benchmarks/results/spec_decode_<tag>.{md,json}.

Another method is one entry in METHODS: name -> (k, args) -> speculative_config (None: no speculation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

import common as C
import spec_workloads as W

# name -> builder of the speculative_config for k draft tokens (draft_model / medusa add theirs here)
METHODS: dict[str, Callable[[int, argparse.Namespace], dict | None]] = {
    "none": lambda k, args: None,
    "ngram": lambda k, args: {"method": "ngram", "num_speculative_tokens": k,
                              "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max},
    # ngram with k drafts after every match (the rule before session 14's per-request draft length)
    "ngram_fixed": lambda k, args: {**METHODS["ngram"](k, args), "draft_length": "fixed"},
    # as many drafts as the match has agreed (session 14's rule)
    "ngram_match": lambda k, args: {**METHODS["ngram"](k, args), "draft_length": "match"},
    # the draft length with the most expected tokens per unit of step time (session 15, ngram_policy.py)
    "ngram_cost": lambda k, args: {**METHODS["ngram"](k, args), "draft_length": "cost"},
    # ngram candidate trees: depth k, at most --tree-nodes nodes (greedy rows), verified in one step
    "ngram_tree": lambda k, args: {**METHODS["ngram"](k, args), "tree_nodes": max(k, args.tree_nodes)},
    # ngram with adaptive k (opt-in): each sequence asks for the drafts (<= k) that pay best; A/B with ngram in one run
    "ngram_adaptive_k": lambda k, args: {**METHODS["ngram"](k, args), "adaptive_k": True},
    # the target's own Q4_1 file read natively (quantization="gguf") as its draft: a self-draft made here
    "draft_model": lambda k, args: {"method": "draft_model", "num_speculative_tokens": k, "quantization": "gguf",
                                    **args.draft_options},
    "medusa": lambda k, args: {"method": "medusa", "num_speculative_tokens": k,
                               "model": args.medusa_heads},  # pagellm train-medusa
    # another set of heads (--medusa-heads-b): two trainings A/B in one run
    "medusa_b": lambda k, args: {**METHODS["medusa"](k, args), "model": args.medusa_heads_b},
    # the heads' top-k candidate tree (medusa_tree.py, --medusa-tree) for greedy rows, verified in one step; k >= depth
    "medusa_tree": lambda k, args: {**METHODS["medusa"](k, args), "tree": args.medusa_tree},
    # the second heads' tree (--medusa-tree-b): two trainings' trees A/B in one run
    "medusa_b_tree": lambda k, args: {**METHODS["medusa_b"](k, args), "tree": args.medusa_tree_b},
}

def workloads(tok, n: int) -> dict[str, list[list[int]]]:
    """Token ids of session 14's fixed-length prompts, what the step-level benches (bench_verify_rows,
    bench_verify_profile, bench_spec_phases) time: "copy" is spec_workloads' copy14, "chat" its chat."""
    loads = W.workloads(tok, n, 0, names=("copy14", "chat"))
    return {"copy": [p.token_ids for p in loads["copy14"]], "chat": [p.token_ids for p in loads["chat"]]}


def run_batches(llm, prompts: list[W.Prompt], batch: int, max_tokens: int | None = None,
                decode_cpu: bool = False) -> dict:
    """The prompts b at a time, each with its max_tokens (capped at `max_tokens`: warm-ups) and EOS rule; a plain
    token id list is a prompt of `max_tokens` new tokens, EOS ignored (the step-level benches' form)."""
    from pagellm import SamplingParams

    prompts = [p if isinstance(p, W.Prompt) else W.Prompt(list(p), max_tokens, True) for p in prompts]

    first_only = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    outs, wall, cpu, prefill_cpu = [], 0.0, 0.0, 0.0
    for i in range(0, len(prompts), batch):
        reqs = [{"prompt_token_ids": p.token_ids} for p in prompts[i : i + batch]]
        params = [SamplingParams(temperature=0.0, max_tokens=min(p.max_tokens, max_tokens or p.max_tokens),
                                 ignore_eos=p.ignore_eos, detokenize=False) for p in prompts[i : i + batch]]
        if decode_cpu:  # the CPU time of prefill + first token alone, to take off: speculation speeds up decoding
            llm.reset_prefix_cache()
            c0 = time.process_time()
            llm.generate(reqs, first_only, use_tqdm=False)
            prefill_cpu += time.process_time() - c0
        llm.reset_prefix_cache()
        t0, c0 = time.perf_counter(), time.process_time()
        outs += llm.generate(reqs, params, use_tqdm=False)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
    spec = [o.metrics.spec_decode for o in outs if o.metrics.spec_decode is not None]
    drafts, accepted, rows = (sum(getattr(m, f) for m in spec) for f in
                              ("num_draft_tokens", "num_accepted_draft_tokens", "num_spec_rows"))
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_s = cpu - prefill_cpu
    switch = getattr(llm.llm_engine, "spec_switch", None)  # its measured draft token cost at this batch size
    cost = switch.draft_token_cost(batch) if switch is not None and hasattr(switch, "draft_token_cost") else None
    return {"tok_s": num_tokens / wall, "tok_cpu_s": num_tokens / cpu,
            "decode_tok_cpu_s": (num_tokens - len(outs)) / decode_s if decode_cpu and decode_s > 0 else float("nan"),
            "tpot_ms": statistics.median(tpots) * 1e3 if tpots else float("nan"),
            "acceptance": accepted / drafts if drafts else 0.0,
            "mean_accepted_len": 1 + accepted / rows if rows else 1.0,
            "draft_token_cost": float("nan") if cost is None else cost,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def run(args) -> dict:
    tok, _ = C.load_tokenizer_for_prompts()
    loads = W.workloads(tok, args.num_prompts, args.output_len, names=args.workloads)
    max_len = max(len(p.token_ids) + p.max_tokens for ps in loads.values() for p in ps)
    configs = [("none", 0)] + [(m, k) for m in args.methods if m != "none" for k in args.ks]
    engines = {}
    for batch in args.batches:
        for method, k in configs:
            spec = METHODS[method](k, args)
            if spec is not None and args.disable_by_batch_size is not None:
                spec["disable_by_batch_size"] = args.disable_by_batch_size
            if spec is not None and args.adaptive == "off":
                spec["adaptive"] = False
            try:
                engines[(batch, method, k)] = C.make_llm("default", max_model_len=max_len + 16,
                                                         max_num_seqs=batch, kv_gb=0.5, speculative_config=spec)
            except ValueError as e:  # e.g. medusa with k above its number of heads
                print(f"[skipped] batch {batch} {method} k={k}: {e}", flush=True)
    for (batch, _, _), llm in engines.items():  # warm-up: one-time kernel and step-graph costs off the measurements
        for prompts in loads.values():  # (a graph is captured per token count: verify rows of 2 .. 1 + k tokens)
            run_batches(llm, prompts[-batch:], batch, args.warmup_tokens)
    runs: dict[tuple, list[dict]] = {}
    for r in range(args.rounds):
        for name, prompts in loads.items():
            for (batch, method, k), llm in engines.items():
                res = run_batches(llm, prompts, batch, decode_cpu=args.decode_cpu)
                runs.setdefault((name, batch, method, k), []).append(res)
                print(f"[round {r}] {name} batch {batch} {method} k={k}: {res['tok_s']:.1f} tok/s, TPOT "
                      f"{res['tpot_ms']:.1f} ms, acceptance {res['acceptance']:.2f}", flush=True)
    return {"results": summarize(runs)}


def summarize(runs: dict[tuple, list[dict]]) -> list[dict]:
    results = []
    for (name, batch, method, k), rs in runs.items():
        base = runs[(name, batch, "none", 0)]
        ratios = [x["tok_s"] / b["tok_s"] for x, b in zip(rs, base)]  # same round: same machine state
        cpu_ratios = [x["tok_cpu_s"] / b["tok_cpu_s"] for x, b in zip(rs, base)]
        decode_ratios = [x["decode_tok_cpu_s"] / b["decode_tok_cpu_s"] for x, b in zip(rs, base)]
        same = sum(a == b for x, bx in zip(rs, base) for a, b in zip(x["token_ids"], bx["token_ids"]))
        results.append({"workload": name, "batch": batch, "method": method, "k": k,
                        "tok_s": statistics.median(x["tok_s"] for x in rs),
                        "tpot_ms": statistics.median(x["tpot_ms"] for x in rs), "ratio": statistics.median(ratios),
                        "cpu_ratio": statistics.median(cpu_ratios),
                        "decode_cpu_ratio": statistics.median(decode_ratios),
                        "acceptance": statistics.median(x["acceptance"] for x in rs),
                        "mean_accepted_len": statistics.median(x["mean_accepted_len"] for x in rs),
                        "draft_token_cost": statistics.median(x.get("draft_token_cost", float("nan")) for x in rs),
                        "same_as_none": same / sum(len(x["token_ids"]) for x in rs),
                        "runs": [{key: v for key, v in x.items() if key != "token_ids"} for x in rs]})
    return results


def render(data: dict) -> str:
    e, a = data["env"], data["args"]
    out = [f"# Speculative decoding ({data['tag']})", "",
           f"{e['time']}, {e['cpu']}, {e['nproc']} cores, torch {e['torch']} ({e['torch_threads']} threads), "
           f"git {e['git_head']}. Load average before: {tuple(round(x, 2) for x in data['load']['load_at_start'])}, "
           f"after: {tuple(round(x, 2) for x in data['load_at_end'])}.", "",
           f"Default model, bf16, greedy, copy: each answer to EOS (max_tokens 1.3x its passage + 48), copy14 / chat: "
           f"{a['output_len']} new tokens per request, {a['num_prompts']} prompts per "
           f"workload, {a['rounds']} interleaved rounds, medians; PAGELLM_NUM_THREADS={a.get('num_threads_env')}; "
           f"adaptive switch {a.get('adaptive', 'on')}, "
           f"disable_by_batch_size {a['disable_by_batch_size'] or 'default'}. 'same as none': share of requests "
           "whose tokens equal no speculation's (bf16 near-ties may flip between the decode and the verify kernels).",
           ""]
    rows = [[r["workload"], r["batch"], r["method"], r["k"] or "-", r["tok_s"], r["tpot_ms"], f"{r['ratio']:.2f}x",
             f"{r['cpu_ratio']:.2f}x",
             f"{r['decode_cpu_ratio']:.2f}x" if r["decode_cpu_ratio"] == r["decode_cpu_ratio"] else "-",  # nan: no --decode-cpu
             f"{r['acceptance']:.2f}" if r["method"] != "none" else "-",
             f"{r['mean_accepted_len']:.2f}" if r["method"] != "none" else "-",
             f"{r['draft_token_cost']:.3f}" if r.get("draft_token_cost", float("nan")) == r.get("draft_token_cost") else "-",
             f"{r['same_as_none']:.0%}"]
            for r in sorted(data["results"],
                            key=lambda r: (r["workload"], r["batch"], r["method"] != "none", r["method"], r["k"]))]
    out.append(C.md_table(["workload", "batch", "method", "k", "tok/s", "TPOT ms", "vs none", "vs none (CPU time)",
                           "decode vs none (CPU time)", "acceptance", "mean accepted len", "c measured", "same as none"], rows))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", type=lambda s: s.split(","), default=["none", "ngram"],
                    help=f"comma-separated, from {sorted(METHODS)}")
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--workloads", type=lambda s: s.split(","), default=["copy", "chat"],
                    help=f"comma-separated, from {list(W.WORKLOADS)} (spec_workloads.py)")
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts per workload")
    ap.add_argument("--output-len", type=int, default=128,
                    help="new tokens per copy14 / chat request (copy: each request's own max_tokens, to EOS)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-cpu", action="store_true",
                    help="also time each batch's prefill + first token alone (CPU) and report decode tokens per "
                         "CPU second")
    # 8 left verify and draft graph keys (1 + k tokens, clamped drafts, other table widths) to be first seen, run
    # eagerly and captured inside the measured rounds (none has one key, so only the speculative engines paid): one
    # session-13 run each gave ngram 1.17x / 1.23x decode per CPU second with 8 against 1.28-1.35x with 24
    ap.add_argument("--warmup-tokens", type=int, default=24,
                    help="new tokens per request of the warm-up (one batch of each workload per engine)")
    ap.add_argument("--prompt-lookup-min", type=int, default=1)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    ap.add_argument("--tree-nodes", type=int, default=8, help="ngram_tree: the tree's most nodes (at least k)")
    ap.add_argument("--medusa-heads", default="/tmp/medusa-smollm2", help="heads from `pagellm train-medusa --output`")
    ap.add_argument("--medusa-heads-b", default=None, help="medusa_b: a second heads directory (A/B of trainings)")
    ap.add_argument("--medusa-tree", default="default",
                    help="medusa_tree: a named tree (default: 12 nodes, depth 3; heads / heads:N: one fitted to the "
                         "heads by pagellm train-medusa) or a JSON list of top-k paths")
    ap.add_argument("--medusa-tree-b", default="default",
                    help="medusa_b_tree: the tree for --medusa-heads-b (as --medusa-tree; \"heads\": their fitted tree)")
    ap.add_argument("--draft-options", type=json.loads, default={},
                    help='draft_model: extra speculative_config keys as JSON, e.g. \'{"num_layers": 20}\'')
    ap.add_argument("--adaptive", choices=["on", "off"], default="on",
                    help="off: every sequence drafts (below the batch limit) whatever its acceptance")
    ap.add_argument("--threads", default="auto",
                    help="torch threads; auto: torch's default if the load wait succeeded, else 1")
    ap.add_argument("--wait-load", type=float, default=2.5)
    ap.add_argument("--wait-timeout", type=float, default=300)
    ap.add_argument("--tag", default="full")
    ap.add_argument("--pagellm-src", default=None,
                    help="import pagellm from this python/ dir (another checkout's package with its built _C): the "
                         "'before' arm of a before/after pair of runs")
    args = ap.parse_args()
    for name in ("medusa_tree", "medusa_tree_b"):
        if getattr(args, name).lstrip().startswith("["):
            setattr(args, name, json.loads(getattr(args, name)))
    if args.pagellm_src:
        import bench_step_profile

        bench_step_profile.use_pagellm_from(args.pagellm_src)
    args.num_threads_env = os.environ.get("PAGELLM_NUM_THREADS", "unset (all CPUs)")
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown methods {unknown}; known: {sorted(METHODS)}")
    if not args.workloads or set(args.workloads) - set(W.WORKLOADS):
        ap.error(f"--workloads: a comma-separated subset of {W.WORKLOADS}, got {args.workloads}")
    load = C.wait_for_load(args.wait_load, args.wait_timeout) if args.wait_load > 0 else {
        "waited_s": 0, "load_ok": None, "load_at_start": C.loadavg()}
    C.setup_threads(1 if args.threads == "auto" and not load["load_ok"] else
                    (None if args.threads == "auto" else int(args.threads)))
    data = {"tag": args.tag, "env": C.env_info(), "load": load, "args": vars(args), **run(args)}
    data["load_at_end"] = C.loadavg()
    md = render(data)
    print("\n" + md, flush=True)
    C.save_results(f"spec_decode_{args.tag}", md, data)


if __name__ == "__main__":
    main()
