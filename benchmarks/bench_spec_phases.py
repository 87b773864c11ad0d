#!/usr/bin/env python
"""Where a batch-1 speculative step's time goes, per method, in wall and CPU time (issue 17, session 13).

    python benchmarks/bench_spec_phases.py                                # none, ngram k=3, draft_model (own Q4_1)
    PAGELLM_NUM_THREADS=1 python benchmarks/bench_spec_phases.py --prompts 4 --output-len 64
    python benchmarks/bench_spec_phases.py --configs none,draft --adaptive on

Default model, bf16, greedy, bench_spec_decode's copy prompts (the last two of its 8 warm up) one at a time through the engine's own step loop (what
LLM.generate runs); each request's prefill step is left out. Every decode step is split into the proposer (for
draft_model: the draft's prompt catch-up, its catch-up of the tokens accepted since the last step, its decode steps),
the target's model step (forward + LM head, `execute_model`), verification / sampling and the rest. Steps are grouped
by kind: plain steps, spec steps (drafts verified), and a draft model's first decode step of each request (the
draft's prefill of the prompt). Per group: median ms per phase (wall, and CPU time of this process: with
PAGELLM_NUM_THREADS=1 the CPU time leaves out waiting for a core on a loaded machine), and per config the CPU time per
generated decode token against no speculation. `--adaptive off` (default) drafts at every step; `on` is the switch.
Writes benchmarks/results/spec_phases_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import bench_spec_decode as S
import common as C

CONFIGS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
    "draft": {"method": "draft_model", "num_speculative_tokens": 3, "quantization": "gguf"},  # the model's own Q4_1
}
PHASES = ("draft prompt catch-up", "draft catch-up", "draft decode", "proposer other", "model step (target)",
          "verify / sample", "other")


class PhaseClock:
    """Wall and CPU seconds per phase of the step in progress (nested phases are subtracted by the caller)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def wrap(self, phase, fn):
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[phase if isinstance(phase, str) else phase(*args)] += time.perf_counter() - w
                self.cpu[phase if isinstance(phase, str) else phase(*args)] += time.process_time() - c
        return timed

    def take(self) -> tuple[dict, dict]:
        wall, cpu = dict(self.wall), dict(self.cpu)
        self.wall.clear()
        self.cpu.clear()
        return wall, cpu


def draft_phase(rows) -> str:
    """A draft forward's phase: inside DraftModelProposer._catch_up a catch-up (of a prompt: more than 8 tokens),
    else one of its decode steps."""
    if not _in_catch_up["on"]:
        return "draft decode"
    return "draft prompt catch-up" if sum(len(r.token_ids) for r in rows) > 8 else "draft catch-up"


_in_catch_up = {"on": False}


def instrument(eng, clock: PhaseClock) -> None:
    eng.executor.execute_model = clock.wrap("model step (target)", eng.executor.execute_model)
    for name in ("_sample_and_verify", "_sample"):
        setattr(eng, name, clock.wrap("verify / sample", getattr(eng, name)))
    if eng.proposer is None:
        return
    eng._propose_drafts = clock.wrap("proposer", eng._propose_drafts)
    runner = getattr(eng.proposer, "runner", None)
    if runner is not None:
        runner.forward = clock.wrap(draft_phase, runner.forward)
        catch_up = eng.proposer._catch_up

        def flagged(plans):
            _in_catch_up["on"] = True
            try:
                return catch_up(plans)
            finally:
                _in_catch_up["on"] = False
        eng.proposer._catch_up = flagged


def split(wall: dict, cpu: dict, step_w: float, step_c: float) -> tuple[dict, dict]:
    out = []
    for d, total in ((wall, step_w), (cpu, step_c)):
        ms = {p: d.get(p, 0.0) * 1e3 for p in PHASES}
        drafted = sum(ms[p] for p in PHASES[:3])
        ms["proposer other"] = max(d.get("proposer", 0.0) * 1e3 - drafted, 0.0)
        ms["other"] = total * 1e3 - sum(ms[p] for p in PHASES[:-1])
        ms["step"] = total * 1e3
        out.append(ms)
    return out[0], out[1]


def profile(label: str, spec: dict | None, prompts: list[list[int]], warmup_prompts: list[list[int]], args) -> dict:
    from pagellm import SamplingParams

    if spec is not None:
        spec = {**spec, "adaptive": args.adaptive == "on"}
    llm = C.make_llm("default", max_model_len=max(map(len, prompts)) + args.output_len + 16, max_num_seqs=1,
                     kv_gb=0.5, speculative_config=spec)
    eng = llm.llm_engine
    warm = SamplingParams(temperature=0.0, max_tokens=args.warmup_tokens, ignore_eos=True, detokenize=False)
    # graphs captured on prompts not measured (the draft's own prefix cache would otherwise hold a measured prompt)
    llm.generate([{"prompt_token_ids": p} for p in warmup_prompts], warm, use_tqdm=False)
    clock = PhaseClock()
    instrument(eng, clock)
    groups: dict[str, list[tuple[dict, dict]]] = defaultdict(list)
    tokens, cpu_total = 0, 0.0
    spec_rows = eng.spec_stats.num_spec_rows if eng.proposer is not None else 0
    accepted0, rows0 = (eng.spec_stats.num_accepted_draft_tokens, spec_rows) if eng.proposer is not None else (0, 0)
    for i, prompt in enumerate(prompts):
        eng.reset_prefix_cache()
        sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0, detokenize=False)
        eng.add_request(f"{label}-{i}", {"prompt_token_ids": prompt}, sp)
        eng.step()  # prefill + first token: not a decode step
        clock.take()
        first = True
        while eng.has_unfinished_requests():
            w, c = time.perf_counter(), time.process_time()
            outs = eng.step()
            w, c = time.perf_counter() - w, time.process_time() - c
            cpu_total += c
            wall_ms, cpu_ms = split(*clock.take(), w, c)
            prev_rows, spec_rows = spec_rows, eng.spec_stats.num_spec_rows if eng.proposer is not None else 0
            if eng.proposer is None:
                kind = "plain"
            elif first and wall_ms["draft prompt catch-up"]:
                kind = "first decode (draft prefill)"
            else:
                kind = "spec" if spec_rows != prev_rows else "no drafts"
            groups[kind].append((wall_ms, cpu_ms))
            first = False
            for o in outs:
                if o.finished:
                    tokens += len(o.outputs[0].token_ids) - 1
    rows = {kind: {"num_steps": len(steps),
                   "wall_ms": {p: statistics.median(s[0][p] for s in steps) for p in (*PHASES, "step")},
                   "cpu_ms": {p: statistics.median(s[1][p] for s in steps) for p in (*PHASES, "step")}}
            for kind, steps in groups.items()}
    rows_run = spec_rows - rows0
    mean_len = 1 + (eng.spec_stats.num_accepted_draft_tokens - accepted0) / rows_run if rows_run else None
    del llm, eng
    return {"groups": rows, "decode_tokens": tokens, "cpu_ms_per_token": cpu_total * 1e3 / max(tokens, 1),
            "mean_accepted_len": mean_len}


def render(data: dict) -> str:
    cols = [(r["label"], kind, g) for r in data["results"] for kind, g in r["groups"].items()]
    head = ["phase (median ms: wall / CPU)"] + [f"{label}: {kind} ({g['num_steps']} steps)" for label, kind, g in cols]
    body = [[p] + [f"{g['wall_ms'][p]:.2f} / {g['cpu_ms'][p]:.2f}" for _, _, g in cols] for p in (*PHASES, "step")]
    base = next((r for r in data["results"] if r["label"] == "none"), None)
    summary = [[r["label"], r["decode_tokens"], f"{r['cpu_ms_per_token']:.2f}",
                f"{base['cpu_ms_per_token'] / r['cpu_ms_per_token']:.2f}x" if base else "-",
                "-" if r["mean_accepted_len"] is None else f"{r['mean_accepted_len']:.2f}"] for r in data["results"]]
    e = data["env"]
    return "\n".join([
        f"# Batch-1 speculative step phases ({data['tag']})", "",
        f"{e['cpu']}, {e['nproc']} cores, PAGELLM_NUM_THREADS={data['args']['num_threads_env']}, git {e['git_head']}; "
        f"load {data['load_start'][0]:.2f} at start, {data['load_end'][0]:.2f} at end. Default model bf16, "
        f"{data['args']['prompts']} copy prompts one at a time, {data['args']['output_len']} new tokens, adaptive switch "
        f"{data['args']['adaptive']}.", "", C.md_table(head, body), "",
        C.md_table(["config", "decode tokens", "CPU ms / decode token (all decode steps)", "vs none",
                    "mean accepted len"], summary)])


def main() -> None:
    import os

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS), help=f"from {list(CONFIGS)}")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--adaptive", choices=["on", "off"], default="off")
    ap.add_argument("--tag", default="copy")
    args = ap.parse_args()
    args.num_threads_env = os.environ.get("PAGELLM_NUM_THREADS", "unset (all CPUs)")
    tok, _ = C.load_tokenizer_for_prompts()
    if not 1 <= args.prompts <= 6:
        ap.error("--prompts: 1 to 6 (two more copy prompts warm up)")
    copy = S.workloads(tok, 8)["copy"]
    prompts, warmup_prompts = copy[: args.prompts], copy[-2:]
    load_start = C.loadavg()
    results = []
    for label in args.configs:
        print(f"[phases] {label}", flush=True)
        results.append({"label": label, **profile(label, CONFIGS[label], prompts, warmup_prompts, args)})
    data = {"tag": args.tag, "env": C.env_info(), "args": vars(args), "load_start": load_start,
            "load_end": C.loadavg(), "results": results}
    md = render(data)
    print("\n" + md, flush=True)
    C.save_results(f"spec_phases_{args.tag}", md, data)


if __name__ == "__main__":
    main()
