#!/usr/bin/env python
"""Where a batch-1 speculative verify step's time goes, beside a plain decode step (issue 17).

    python benchmarks/bench_verify_profile.py                       # ngram k=3 vs none, copy prompts
    python benchmarks/bench_verify_profile.py --ks 3,8 --prompts 4 --output-len 64
    python benchmarks/bench_verify_profile.py --configs '{"method": "ngram", "num_speculative_tokens": 8, "tree_nodes": 16}'
    python benchmarks/bench_verify_profile.py --workload chat --ks '' --clock thread \
        --configs '{"method": "medusa", "num_speculative_tokens": 3, "model": "/work/medusa-s15", "adaptive": false}'

`--clock thread` times every phase in this thread's CPU time (time.thread_time): with PAGELLM_NUM_THREADS=1 the
kernels run on the calling thread, so a loaded machine's waits for a core drop out. Medusa / Hydra engines get
their own phases: the heads' ResBlocks and LM head, the rest of propose() (top-k, tree building, Python), the
switch and draft checks, the tree's parents, mask and positions (or a chain's per-token metadata), the hidden
states' gather and hand-over, and the verification's tree paths, sampler.verify and KV moves.

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

# the spec-only phases: the proposer's parts, then the engine's and the runner's spec work around the step
PROPOSER_PHASES = ("heads resblocks", "heads lm head", "propose() rest", "switch + checks")
SPEC_PHASES = ("draft parents", "verify inputs", "hidden gather", "tree paths", "sampler.verify", "commit tree",
               "verify rest", "observe hidden")
PHASES = (*PROPOSER_PHASES, *P.PHASES[:-1], *SPEC_PHASES, "other")


def instrument_spec(eng, timers: P.StepTimers):
    """bench_step_profile's timers plus the proposer and verification phases; returns undo."""
    from pagellm.engine import model_runner as MR

    undo = P.instrument(eng, timers)
    runner = eng.runner
    if hasattr(runner, "_tree_with_graph"):  # a tree step's replay (absent from older checkouts)
        runner._tree_with_graph = timers.wrap("forward+pad", runner._tree_with_graph)
    names = {"_propose_drafts": "proposer", "_sample_and_verify": "verify+", "_draft_parents": "draft parents",
             "_tree_paths": "tree paths", "_commit_tree_paths": "commit tree", "_observe_hidden_states": "observe hidden"}
    saved = {k: eng.__dict__.get(k) for k in names if hasattr(eng, k)}
    for k in saved:
        setattr(eng, k, timers.wrap(names[k], getattr(eng, k)))
    sampler_verify = eng.sampler.__dict__.get("verify")
    eng.sampler.verify = timers.wrap("sampler.verify", eng.sampler.verify)
    module_fns = {k: getattr(MR, k) for k in ("tree_step_inputs", "_rows_as_decode_tokens", "gather_rows")
                  if hasattr(MR, k)}
    for k, fn in module_fns.items():
        setattr(MR, k, timers.wrap("hidden gather" if k == "gather_rows" else "verify inputs", fn))
    prop = eng.proposer
    heads = getattr(prop, "heads", None)
    if heads is not None:  # Medusa / Hydra: the heads' own products
        prop.propose = timers.wrap("propose()", prop.propose)
        prop.lm_head = timers.wrap("heads lm head", prop.lm_head)
        if hasattr(heads, "step"):  # Hydra: one head step at a time
            heads.step = timers.wrap("heads resblocks", heads.step)
        else:
            heads.head_states = timers.wrap("heads resblocks", heads.head_states)

    def undo_all() -> None:
        for k in saved:
            eng.__dict__.pop(k, None)
        eng.sampler.__dict__.pop("verify", None)
        if sampler_verify is not None:
            eng.sampler.verify = sampler_verify
        for k, fn in module_fns.items():
            setattr(MR, k, fn)
        if heads is not None:
            for obj, k in ((prop, "propose"), (heads, "step"), (heads, "head_states")):
                obj.__dict__.pop(k, None)
        runner.__dict__.pop("_tree_with_graph", None)
        undo()
    return undo_all


def split_phases(seconds: dict[str, float], step_s: float) -> dict[str, float]:
    """ms per phase of one step (nested timers resolved as in bench_step_profile): the proposer holds propose(),
    which holds the heads' products; the verification holds the sampling phases, tree paths, sampler.verify and
    the KV moves."""
    s = dict(seconds)
    lm_head = s.pop("heads lm head", 0.0)
    extra = {"heads resblocks": s.pop("heads resblocks", 0.0), "heads lm head": lm_head}
    extra["propose() rest"] = s.pop("propose()", 0.0) - extra["heads resblocks"] - lm_head
    proposer = s.pop("proposer", 0.0)
    extra["switch + checks"] = proposer - (extra["propose() rest"] + extra["heads resblocks"] + lm_head) if proposer else 0.0
    for k in SPEC_PHASES:
        if k != "verify rest":
            extra[k] = s.pop(k, 0.0)
    verify = s.pop("verify+", 0.0)
    if verify:  # the sampling phases inside _sample_and_verify count as themselves
        verify -= sum(s.get(k, 0.0) for k in ("sampling rows", "sampler", "output processing"))
        verify -= extra["tree paths"] + extra["sampler.verify"] + extra["commit tree"]
    extra["verify rest"] = verify
    top = proposer + verify + sum(extra[k] for k in SPEC_PHASES if k != "verify rest")
    ms = P.phases_per_step(s, step_s - top, 1)
    ms.update({k: v * 1e3 for k, v in extra.items()})
    return ms


def profile_engine(label: str, spec: dict | None, prompts: list[list[int]], args) -> dict:
    from pagellm import SamplingParams

    llm = C.make_llm("default", max_model_len=max(map(len, prompts)) + args.output_len + 16, max_num_seqs=1,
                     kv_gb=0.5, speculative_config=spec)
    eng = llm.llm_engine
    warm = SamplingParams(temperature=0.0, max_tokens=args.warmup_tokens, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], warm, use_tqdm=False)  # graphs captured
    timers = P.StepTimers(time.thread_time if args.clock == "thread" else time.perf_counter)
    undo = instrument_spec(eng, timers)
    totals = {"steps_ms": 0.0, "tokens": 0}
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
                t = timers.clock()
                outs = eng.step()
                dt = timers.clock() - t
                ms = split_phases({k: v - before.get(k, 0.0) for k, v in timers.seconds.items()}, dt)
                kind = "plain" if timers.seconds.get("verify+", 0.0) == before.get("verify+", 0.0) else "verify"
                groups[f"{label} {kind}"].append({**ms, "step": dt * 1e3})
                totals["steps_ms"] += dt * 1e3
                for o in outs:
                    if o.finished:
                        totals["tokens"] += len(o.outputs[0].token_ids) - 1  # the prefill's token untimed
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
                     "phases_ms": {k: statistics.median(s[k] for s in steps) for k in PHASES},
                     "mean_phases_ms": {k: statistics.fmean(s[k] for s in steps) for k in PHASES}}
    del llm, eng
    return {"groups": out, "replays": replays, "ms_per_token": totals["steps_ms"] / max(1, totals["tokens"]),
            "mean_accepted_len": statistics.fmean(accepted_lens) if accepted_lens else None}


def render(data: dict) -> str:
    groups = {name: g for r in data["results"] for name, g in r["groups"].items()}
    names = list(groups)
    base = next((g for n, g in groups.items() if n.startswith("none")), None)
    used = [p for p in PHASES if any(abs(groups[n]["phases_ms"].get(p, 0.0)) >= 0.0005 for n in names)]
    rows = [[p] + [f"{groups[n]['phases_ms'].get(p, 0.0):.3f}" for n in names] for p in used]
    rows.append(["**median step**"] + [f"**{groups[n]['step_ms']:.2f}**" for n in names])
    # means too: a rare costly phase (a tree path's KV moves) is invisible in the medians
    means = [p for p in PHASES if any(abs(groups[n].get("mean_phases_ms", {}).get(p, 0.0)) >= 0.0005 for n in names)]
    rows.extend([f"{p} (mean)"] + [f"{groups[n].get('mean_phases_ms', {}).get(p, 0.0):.3f}" for n in names]
                for p in means)
    rows.append(["mean step"] + [f"{groups[n]['mean_step_ms']:.2f}" for n in names])
    rows.append(["steps"] + [str(groups[n]["num_steps"]) for n in names])
    if base is not None:
        rows.append(["median step / plain"] + [f"{groups[n]['step_ms'] / base['step_ms']:.2f}x" for n in names])
    out = [f"# Batch-1 verify step vs plain decode step ({data['tag']})", "",
           f"{data['env']['cpu']}, {data['env']['torch_threads']} torch threads, git {data['env']['git_head']}; "
           f"load {data['load_start'][0]:.2f} at start, {data['load_end'][0]:.2f} at end. Default model bf16, "
           f"{data['args']['prompts']} {data['args'].get('workload', 'copy')} prompts one at a time, "
           f"{data['args']['output_len']} new tokens; median ms per phase over each group's steps "
           f"({data['args'].get('clock', 'wall')} clock).", "", C.md_table(["phase"] + names, rows), ""]
    base_tok = next((r["ms_per_token"] for r in data["results"] if r["label"] == "none"), None)
    for r in data["results"]:
        per_tok = r.get("ms_per_token")
        speed = f" ({base_tok / per_tok:.2f}x none)" if base_tok and per_tok else ""
        out.append(f"- {r['label']}: step-graph replays by key {r['replays'] or 'none'}; mean accepted length "
                   f"{r['mean_accepted_len'] if r['mean_accepted_len'] is None else round(r['mean_accepted_len'], 2)}; "
                   f"ms per token (all timed steps) {per_tok:.3f}{speed}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",") if x], default=[3],
                    help="ngram k's ('' for none)")
    ap.add_argument("--workload", choices=["copy", "chat"], default="copy")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="thread: this thread's CPU time (run with PAGELLM_NUM_THREADS=1 so the kernels run on it)")
    ap.add_argument("--labels", type=lambda s: s.split(";"), default=None,
                    help="names of the --configs, ';'-separated (default: their JSON)")
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
    prompts = S.workloads(tok, args.prompts)[args.workload]
    configs = [("none", None)] + [(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k, "adaptive": False})
                                  for k in args.ks]
    labels = args.labels or [json.dumps(c, separators=(",", ":")) for c in args.configs]
    configs += list(zip(labels, args.configs))
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
