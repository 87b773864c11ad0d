#!/usr/bin/env python
"""Where a batch-1 speculative verify step's time goes, beside a plain decode step (issue 17).

    python benchmarks/bench_verify_profile.py                       # ngram k=3 vs none, copy prompts
    python benchmarks/bench_verify_profile.py --ks 3,8 --prompts 4 --output-len 64
    python benchmarks/bench_verify_profile.py --configs '{"method": "ngram", "num_speculative_tokens": 8, "tree_nodes": 16}'

Default model, bf16, greedy, one copy-heavy request at a time (bench_spec_decode's `copy` workload). Every
decode step is split by the instance-level timers of bench_step_profile (engine code untouched), plus two
spec-only phases: `proposer` (LLMEngine._propose_drafts: the switch, the proposer, the draft checks) and
`verify` (_sample_and_verify less the sampling phases it calls). Steps are grouped by kind: plain decode
steps of the engine without speculation, and, for each speculative engine, its steps that carried drafts
and those that did not. Median per phase over the group's steps (ms), the
step-graph replays per token count, and the cost ratio a verify step has to a plain one.
Writes benchmarks/results/verify_profile_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import bench_spec_decode as S
import bench_step_profile as P
import common as C

PHASES = ("proposer", *P.PHASES[:-1], "verify", "other")


def instrument_spec(eng, timers: P.StepTimers):
    """bench_step_profile's timers plus the proposer and verification phases; returns undo."""
    undo = P.instrument(eng, timers)
    runner = eng.runner
    if hasattr(runner, "_tree_with_graph"):  # a tree step's replay (absent from older checkouts)
        runner._tree_with_graph = timers.wrap("forward+pad", runner._tree_with_graph)
    saved = {k: eng.__dict__.get(k) for k in ("_propose_drafts", "_sample_and_verify")}
    eng._propose_drafts = timers.wrap("proposer", getattr(eng, "_propose_drafts"))
    eng._sample_and_verify = timers.wrap("verify+", getattr(eng, "_sample_and_verify"))

    def undo_all() -> None:
        for k in saved:
            eng.__dict__.pop(k, None)
        runner.__dict__.pop("_tree_with_graph", None)
        undo()
    return undo_all


def split_phases(seconds: dict[str, float], step_s: float) -> dict[str, float]:
    """ms per phase of one step (nested timers resolved as in bench_step_profile)."""
    s = dict(seconds)
    proposer = s.pop("proposer", 0.0)
    verify = s.pop("verify+", 0.0)
    if verify:  # the sampling phases inside _sample_and_verify count as themselves
        verify -= sum(s.get(k, 0.0) for k in ("sampling rows", "sampler", "output processing"))
    ms = P.phases_per_step(s, step_s - proposer - verify, 1)
    ms["proposer"], ms["verify"] = proposer * 1e3, verify * 1e3
    return ms


def profile_engine(label: str, spec: dict | None, prompts: list[list[int]], args) -> dict:
    from pagellm import SamplingParams

    llm = C.make_llm("default", max_model_len=max(map(len, prompts)) + args.output_len + 16, max_num_seqs=1,
                     kv_gb=0.5, speculative_config=spec)
    eng = llm.llm_engine
    warm = SamplingParams(temperature=0.0, max_tokens=args.warmup_tokens, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], warm, use_tqdm=False)  # graphs captured
    timers = P.StepTimers()
    undo = instrument_spec(eng, timers)
    groups: dict[str, list[dict]] = defaultdict(list)
    graphs = eng.runner.step_graphs
    replays_before = dict(graphs.num_replays_by_key) if graphs is not None else {}
    accepted_lens = []
    try:
        for i, prompt in enumerate(prompts):
            eng.reset_prefix_cache()
            sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0, detokenize=False)
            eng.add_request(f"{label}-{i}", {"prompt_token_ids": prompt}, sp)
            eng.step()  # prefill + first token, untimed
            timers.active = True
            while eng.has_unfinished_requests():
                before = dict(timers.seconds)
                t = time.perf_counter()
                outs = eng.step()
                dt = time.perf_counter() - t
                ms = split_phases({k: v - before.get(k, 0.0) for k, v in timers.seconds.items()}, dt)
                kind = "plain" if ms["verify"] == 0.0 else "verify"
                groups[f"{label} {kind}"].append({**ms, "step": dt * 1e3})
                for o in outs:
                    if o.finished and o.metrics.spec_decode is not None:
                        m = o.metrics.spec_decode
                        accepted_lens.append(1 + m.num_accepted_draft_tokens / max(1, m.num_spec_rows))
            timers.active = False
    finally:
        undo()
    replays = {str(k): v - replays_before.get(k, 0) for k, v in (graphs.num_replays_by_key.items() if graphs else [])
               if v - replays_before.get(k, 0)}
    out = {}
    for name, steps in groups.items():
        out[name] = {"num_steps": len(steps), "step_ms": statistics.median(s["step"] for s in steps),
                     "mean_step_ms": statistics.fmean(s["step"] for s in steps),
                     "phases_ms": {k: statistics.median(s[k] for s in steps) for k in PHASES}}
    del llm, eng
    return {"groups": out, "replays": replays,
            "mean_accepted_len": statistics.fmean(accepted_lens) if accepted_lens else None}


def render(data: dict) -> str:
    groups = {name: g for r in data["results"] for name, g in r["groups"].items()}
    names = list(groups)
    base = next((g for n, g in groups.items() if n.startswith("none")), None)
    rows = [[p] + [f"{groups[n]['phases_ms'][p]:.3f}" for n in names] for p in PHASES]
    rows.append(["**median step**"] + [f"**{groups[n]['step_ms']:.2f}**" for n in names])
    rows.append(["mean step"] + [f"{groups[n]['mean_step_ms']:.2f}" for n in names])
    rows.append(["steps"] + [str(groups[n]["num_steps"]) for n in names])
    if base is not None:
        rows.append(["median step / plain"] + [f"{groups[n]['step_ms'] / base['step_ms']:.2f}x" for n in names])
    out = [f"# Batch-1 verify step vs plain decode step ({data['tag']})", "",
           f"{data['env']['cpu']}, {data['env']['torch_threads']} torch threads, git {data['env']['git_head']}; "
           f"load {data['load_start'][0]:.2f} at start, {data['load_end'][0]:.2f} at end. Default model bf16, "
           f"{data['args']['prompts']} copy prompts one at a time, {data['args']['output_len']} new tokens; median "
           "ms per phase over each group's steps.", "", C.md_table(["phase"] + names, rows), ""]
    for r in data["results"]:
        out.append(f"- {r['label']}: step-graph replays by key {r['replays'] or 'none'}; mean accepted length "
                   f"{r['mean_accepted_len'] if r['mean_accepted_len'] is None else round(r['mean_accepted_len'], 2)}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[3])
    ap.add_argument("--configs", type=lambda s: [json.loads(x) for x in s.split(";")], default=[],
                    help="extra speculative_configs as JSON, ';'-separated")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tag", default="ngram")
    ap.add_argument("--pagellm-src", default=None,
                    help="import pagellm from this python/ dir (another checkout's package with its built _C): a before run")
    args = ap.parse_args()
    if args.pagellm_src:
        P.use_pagellm_from(args.pagellm_src)
    C.setup_threads(args.threads)
    tok, _ = C.load_tokenizer_for_prompts()
    prompts = S.workloads(tok, args.prompts)["copy"]
    configs = [("none", None)] + [(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k, "adaptive": False})
                                  for k in args.ks]
    configs += [(json.dumps(c, separators=(",", ":")), c) for c in args.configs]
    load_start = C.loadavg()
    results = []
    for label, spec in configs:
        print(f"[profile] {label}", flush=True)
        results.append({"label": label, **profile_engine(label, spec, prompts, args)})
    data = {"tag": args.tag, "env": C.env_info(), "args": vars(args), "load_start": load_start,
            "load_end": C.loadavg(), "results": results}
    md = render(data)
    print("\n" + md, flush=True)
    C.save_results(f"verify_profile_{args.tag}", md, data)


if __name__ == "__main__":
    main()
