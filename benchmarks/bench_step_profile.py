#!/usr/bin/env python
"""Where a batch-1 decode step's wall time goes, and the memory traffic it moves (issue 22).

    python benchmarks/bench_step_profile.py                       # default model, bf16 and fp32
    python benchmarks/bench_step_profile.py --model-size 1b       # random TinyLlama-1.1B-shaped bf16 model
    python benchmarks/bench_step_profile.py --quick               # 32 decode tokens, 1 repeat
    python benchmarks/bench_step_profile.py --ab-baseline /tmp/head/python   # before/after, interleaved
        # (/tmp/head/python: `git archive <commit> python/pagellm` + the built _C*.so copied into its pagellm/)

One request at a time (or --batch N together) through LLMEngine.add_request / step (greedy, or --sampling
sampled / top-p / greedy-lp / sampled-lp; ignore_eos, detokenized unless --no-detokenize), prompt --prompt-len
tokens, --output-len new tokens; --clock cpu times everything in the calling thread's CPU time. Every decode
step (the prefill step excluded) is split by instance-level timers around the engine's own functions (engine code
untouched):

    scheduler.schedule | step bookkeeping (_begin_rows) | input preparation (metadata, tensors, padding)
    | forward (step-graph replay, or eager) | LM head (compute_logits) | sampling rows | sampler
    | output processing (append, stop checks) | detokenization | scheduler.update (+ its arguments)
    | RequestOutputs | other (the rest of engine.step, the executor call)

The forward is split by op kind with torch.profiler over eager decode steps of the same request shape
(the step graph off for them): each kind's share of the native self time, times the replay's forward time
("scaled"); the eager Python share is reported beside it. Memory traffic: weight bytes (every unique
parameter once; an untied input embedding one row) + KV bytes per context token x the mean context, over
the copy bandwidth measured in the same run (a large tensor.copy_, read + write): MBU of the forward
(+ LM head) alone and of the whole step (TPOT). Writes benchmarks/results/step_profile_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict

import common as C
import torch

PHASES = ("scheduler.schedule", "step bookkeeping", "input preparation", "forward", "LM head", "sampling rows",
          "sampler", "output processing", "detokenization", "scheduler.update", "RequestOutputs", "other")


class StepTimers:
    """Accumulated seconds per phase; `wrap` times a callable under a phase name. `clock`: time.perf_counter (wall)
    or time.thread_time (the calling thread's CPU time: robust to preemption on a shared machine, and the host path
    runs on the calling thread; the forward's figure is then the caller's share of the pool's work)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.active = False
        self.clock = clock  # time.thread_time: this thread's CPU time (a loaded machine's waits left out)

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            t = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += self.clock() - t
        return timed

    def reset(self) -> None:
        self.seconds.clear()


class _SchedulerProxy:
    """Stands in for the C++ scheduler: times schedule / update, forwards everything else."""

    def __init__(self, scheduler, timers: StepTimers) -> None:
        self._s = scheduler
        self.schedule = timers.wrap("scheduler.schedule", scheduler.schedule)
        self.update = timers.wrap("scheduler.update", scheduler.update)

    def __getattr__(self, name):
        return getattr(self._s, name)


def instrument(eng, timers: StepTimers) -> callable:
    """Install the timers on one engine (instance attributes and the detokenizer class); returns undo."""
    from pagellm.engine import detokenizer

    runner = eng.runner
    saved_eng = {k: getattr(eng, k) for k in ("scheduler", "_begin_rows", "_build_sampling_rows", "_sample",
                                              "_apply_sampled_tokens", "_collect_outputs", "_report_to_scheduler")}
    saved_runner = {k: runner.__dict__.get(k) for k in ("build_metadata", "_to_device", "_decode_with_graph", "_forward")}
    saved_logits = runner.model.__dict__.get("compute_logits")
    heads = [k for k in ("compute_logits", "compute_greedy_token_ids") if hasattr(runner.model, k)]  # + the fused
    saved_update = detokenizer.IncrementalDetokenizer.update
    eng.scheduler = _SchedulerProxy(eng.scheduler, timers)
    eng._begin_rows = timers.wrap("step bookkeeping", saved_eng["_begin_rows"])
    eng._build_sampling_rows = timers.wrap("sampling rows", saved_eng["_build_sampling_rows"])
    eng._sample = timers.wrap("sampler", saved_eng["_sample"])
    eng._apply_sampled_tokens = timers.wrap("output processing", saved_eng["_apply_sampled_tokens"])
    eng._collect_outputs = timers.wrap("RequestOutputs", saved_eng["_collect_outputs"])
    # scheduler.update's own time is timed inside; the rest of _report_to_scheduler builds its arguments
    eng._report_to_scheduler = timers.wrap("report", saved_eng["_report_to_scheduler"])
    runner.build_metadata = timers.wrap("input preparation", runner.build_metadata)
    runner._to_device = timers.wrap("input preparation", runner._to_device)
    runner._decode_with_graph = timers.wrap("forward+pad", runner._decode_with_graph)
    runner._forward = timers.wrap("forward", runner._forward)
    for k in heads:  # the greedy LM head (linear_argmax) is the LM head and the sampler's argmax in one
        setattr(runner.model, k, timers.wrap("LM head", getattr(runner.model, k)))
    detokenizer.IncrementalDetokenizer.update = timers.wrap("detokenization", saved_update)

    def undo() -> None:
        for k, v in saved_eng.items():
            if k == "scheduler":
                eng.scheduler = v
            else:
                eng.__dict__.pop(k, None)
        for k, v in saved_runner.items():
            runner.__dict__.pop(k, None)
            if v is not None:
                setattr(runner, k, v)
        for k in heads:
            runner.model.__dict__.pop(k, None)
        if saved_logits is not None:
            runner.model.compute_logits = saved_logits
        detokenizer.IncrementalDetokenizer.update = saved_update
    return undo


def phases_per_step(seconds: dict[str, float], step_s: float, steps: int) -> dict[str, float]:
    """Milliseconds per step per phase, nested timers resolved (the step graph's input padding is input
    preparation; the replay inside it is the forward; detokenization is carved out of output processing)."""
    s = dict(seconds)
    fwd = s.pop("forward", 0.0)
    graph = s.pop("forward+pad", 0.0)
    if graph:  # _decode_with_graph = padding + replay (the eager _forward runs only while capturing)
        s["forward"] = graph
    else:
        s["forward"] = fwd
    s["output processing"] = s.get("output processing", 0.0) - s.get("detokenization", 0.0)
    report = s.pop("report", 0.0)
    s["scheduler.update"] = report  # the call and the arrays handed to it
    s["other"] = step_s - sum(v for k, v in s.items() if k in PHASES and k != "other")
    return {k: s.get(k, 0.0) / steps * 1e3 for k in PHASES}


SAMPLING = {  # --sampling modes: what each request asks of the sampler
    "greedy": dict(temperature=0.0),
    "greedy-lp": dict(temperature=0.0, logprobs=5),
    "sampled": dict(temperature=0.8, top_p=0.95, top_k=50, seed=7),
    "sampled-lp": dict(temperature=0.8, top_p=0.95, top_k=50, seed=7, logprobs=5),
    "top-p": dict(temperature=0.8, top_p=0.95, seed=7),
}


def decode_run(eng, prompt: list[int], n_out: int, rid: str, detokenize: bool, timers: StepTimers,
               sampling: str = "greedy", batch: int = 1) -> dict:
    """`batch` requests at once; the steps until each has its first token untimed; returns per-step phase ms, TPOT
    and the step times (on the timers' clock)."""
    from pagellm import SamplingParams

    sp = SamplingParams(max_tokens=n_out, ignore_eos=True, detokenize=detokenize, **SAMPLING[sampling])
    for b in range(batch):
        eng.add_request(f"{rid}-{b}", {"prompt_token_ids": prompt}, sp)
    states = list(eng.output_processor.requests.values())
    while not all(st.seqs[0].output_token_ids for st in states):
        eng.step()  # prefill + first token
    timers.reset()
    timers.active = True
    step_times, per_step = [], []
    clock = timers.clock
    try:
        while eng.has_unfinished_requests():
            before = dict(timers.seconds)
            t = clock()
            eng.step()
            step_times.append(clock() - t)
            per_step.append(phases_per_step({k: v - before.get(k, 0.0) for k, v in timers.seconds.items()},
                                            step_times[-1], 1))
    finally:
        timers.active = False
    total = sum(step_times)
    # the median step, phase by phase: what a step costs when no other process preempts it
    typical = {k: statistics.median(p[k] for p in per_step) for k in PHASES}
    return {"steps": len(step_times), "tpot_ms": total / len(step_times) * 1e3,
            "median_step_ms": statistics.median(step_times) * 1e3,
            "phases_ms": phases_per_step(timers.seconds, total, len(step_times)), "median_phases_ms": typical}


# ---------------------------------------------------------------------------------- ops
def op_kind(name: str) -> str:
    return name.split("::", 1)[-1] if name.startswith("pagellm::") else name


def profile_ops(eng, prompt: list[int], n_out: int, top: int) -> dict:
    """torch.profiler over eager decode steps (the step graph off): self CPU ms per step per op kind."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from pagellm import SamplingParams

    runner = eng.runner
    graphs, runner.step_graphs = runner.step_graphs, None
    try:
        sp = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0, detokenize=False)
        eng.add_request("ops", {"prompt_token_ids": prompt}, sp)
        eng.step()
        forward = runner._forward

        def marked(*a, **k):
            with record_function("forward"):
                return forward(*a, **k)
        runner._forward = marked
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps = 0
            while eng.has_unfinished_requests():
                eng.step()
                steps += 1
    finally:
        runner.__dict__.pop("_forward", None)
        runner.step_graphs = graphs
    events = prof.key_averages()
    fwd = next(e for e in events if e.key == "forward")
    fwd_ms = fwd.cpu_time_total / steps / 1e3
    # ops under the forward: every native op's self time (the ops outside it, sampler / logits, are small)
    ops = [e for e in events if e.key not in ("forward",) and (e.key.startswith("aten::") or e.key.startswith("pagellm::"))]
    native_ms = sum(e.self_cpu_time_total for e in ops) / steps / 1e3
    ops.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [{"op": op_kind(e.key), "calls_per_step": e.count / steps,
             "self_ms_per_step": e.self_cpu_time_total / steps / 1e3} for e in ops]
    head, rest = rows[:top], rows[top:]
    if rest:
        head.append({"op": f"({len(rest)} other ops)", "calls_per_step": sum(r["calls_per_step"] for r in rest),
                     "self_ms_per_step": sum(r["self_ms_per_step"] for r in rest)})
    for r in head:
        r["share_of_native"] = r["self_ms_per_step"] / native_ms if native_ms else 0.0
    return {"steps": steps, "eager_forward_ms": fwd_ms, "native_ms": native_ms, "ops": head}


# ---------------------------------------------------------------------------------- bytes
def weight_bytes(model: torch.nn.Module, hf_config) -> int:
    """Every unique parameter once (buffers such as rope tables are read a row at a time); an untied input
    embedding contributes one row."""
    seen, total, emb = set(), 0, None
    for name, t in model.named_parameters():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
        if name.endswith("embed_tokens.weight"):
            emb = t
    if emb is not None and not getattr(hf_config, "tie_word_embeddings", False):
        total -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    return total


# ---------------------------------------------------------------------------------- driver
def use_pagellm_from(src: str) -> None:
    """Import pagellm from `src` (a dir holding pagellm/ with its _C) rather than the editable install."""
    import sys

    if "pagellm" in sys.modules:
        raise RuntimeError("--pagellm-src must be applied before pagellm is imported")
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
    sys.path.insert(0, src)


def make_llm(model_size: str, dtype: str, max_model_len: int, batch: int = 1):
    from pagellm import LLM

    path = None
    if model_size == "1b":
        import bench_quant_ppl as Q

        path = str(Q.random_1b_model())
    # the default model's KV: 23 KB a token; room for `batch` sequences of max_model_len
    kv_gb = max(0.25, batch * max_model_len * 23040 * 1.2 / 2**30)
    return LLM(model=path, dtype=dtype, max_model_len=max_model_len, max_num_seqs=batch, kv_cache_memory_gb=kv_gb,
               block_size=16, seed=0)


def measure(label: str, args, prompt: list[int], bw_gbs: float) -> dict:
    model_size, dtype = label.split(":")
    print(f"\n=== {label} ===", flush=True)
    llm = make_llm(model_size, dtype, args.prompt_len + args.output_len + 16, args.batch)
    eng = llm.llm_engine
    eng.warmup(prompt_lens=(args.prompt_len,), max_tokens=4)
    timers = StepTimers(time.thread_time if args.clock == "cpu" else time.perf_counter)
    undo = instrument(eng, timers)
    run_args = (not args.no_detokenize, timers, args.sampling, args.batch)
    try:
        decode_run(eng, prompt, 8, "warm", *run_args)  # step graph captured
        runs = []
        for i in range(args.repeats):
            eng.reset_prefix_cache()
            runs.append(decode_run(eng, prompt, args.output_len, f"r{i}", *run_args))
            print(f"[{label}] run {i}: TPOT {runs[-1]['tpot_ms']:.2f} ms", flush=True)
    finally:
        undo()
    best = min(runs, key=lambda r: r["tpot_ms"])
    phases = {k: statistics.median(r["phases_ms"][k] for r in runs) for k in PHASES}
    median_phases = {k: statistics.median(r["median_phases_ms"][k] for r in runs) for k in PHASES}
    tpot = statistics.median(r["tpot_ms"] for r in runs)
    hf = eng.model_files.hf_config
    wbytes = weight_bytes(eng.model, hf)
    mean_ctx = args.prompt_len + args.output_len / 2
    bytes_tok = wbytes + eng.kv_cache_bytes_per_token * mean_ctx
    fwd_ms = phases["forward"] + phases["LM head"]
    ops = {"steps": 0, "eager_forward_ms": 0.0, "native_ms": 0.0, "ops": []}
    if not args.no_ops:
        ops = profile_ops(eng, prompt, min(args.output_len, 16), args.top)
    for r in ops["ops"]:
        r["scaled_ms_per_step"] = r["share_of_native"] * phases["forward"]
    res = {"label": label, "dtype": dtype, "tpot_ms": tpot, "load_after": C.loadavg(), "best_run_tpot_ms": best["tpot_ms"], "phases_ms": phases,
           "median_phases_ms": median_phases, "median_step_ms": statistics.median(r["median_step_ms"] for r in runs),
           "runs": runs, "weight_bytes": wbytes, "kv_bytes_per_ctx_token": eng.kv_cache_bytes_per_token,
           "mean_ctx": mean_ctx, "bytes_per_token": bytes_tok, "forward_ms": fwd_ms,
           "mbu_forward": bytes_tok / (fwd_ms / 1e3) / 1e9 / bw_gbs, "mbu_step": bytes_tok / (tpot / 1e3) / 1e9 / bw_gbs,
           "fixed_ms": tpot - fwd_ms, "ops": ops, "step_graph": eng.runner.step_graphs is not None}
    print(f"[{label}] TPOT {tpot:.2f} ms, forward+head {fwd_ms:.2f} ms, MBU forward {res['mbu_forward']:.2f} "
          f"step {res['mbu_step']:.2f}", flush=True)
    del llm, eng
    gc.collect()
    return res


def render(data: dict) -> str:
    res = data["results"]
    rbw = data.get("read_bandwidth")
    read_bw = f", read-only stream {rbw['best_gbs']:.1f} GB/s (best, torch.sum)" if rbw else ""
    out = [f"# Batch-1 decode step profile ({data['tag']})", "",
           f"{data['env']['cpu']}, {data['env']['torch_threads']} torch threads, load at start "
           f"{data['load'][0]:.2f}; prompt {data['prompt_len']}, {data['output_len']} new tokens, "
           f"{data['repeats']} runs (median); copy bandwidth {data['bandwidth']['best_gbs']:.1f} GB/s (best, "
           f"read + write){read_bw}; detokenize={not data['no_detokenize']}; sampling {data.get('sampling', 'greedy')}, batch "
           f"{data.get('batch', 1)}, clock {data.get('clock', 'wall')}.", "",
           f"## Per-step {'thread CPU' if data.get('clock') == 'cpu' else 'wall'} time (ms)", ""]
    headers = ["phase"] + [r["label"] for r in res]
    rows = [[p] + [f"{r['phases_ms'][p]:.3f}" for r in res] for p in PHASES]
    rows.append(["**step (TPOT)**"] + [f"**{r['tpot_ms']:.2f}**" for r in res])
    rows.append(["fixed (TPOT - forward - LM head)"] + [f"{r['fixed_ms']:.2f}" for r in res])
    rows.append(["bytes / token (MB)"] + [f"{r['bytes_per_token'] / 1e6:.1f}" for r in res])
    rows.append(["MBU forward + LM head"] + [f"{r['mbu_forward']:.2f}" for r in res])
    rows.append(["MBU step"] + [f"{r['mbu_step']:.2f}" for r in res])
    if rbw:
        rows.append(["MBU forward + LM head (read-only ceiling)"] + [f"{r['mbu_forward_read']:.2f}" for r in res])
        rows.append(["MBU step (read-only ceiling)"] + [f"{r['mbu_step_read']:.2f}" for r in res])
    out += [C.md_table(headers, rows), "", "## The median step, phase by phase (ms; robust to preemption by other "
            "processes, so the phases need not add up to it)", ""]
    rows = [[p] + [f"{r['median_phases_ms'][p]:.3f}" for r in res] for p in PHASES]
    rows.append(["**median step**"] + [f"**{r['median_step_ms']:.2f}**" for r in res])
    out += [C.md_table(headers, rows), ""]
    for r in res:
        o = r["ops"]
        if not o["ops"]:
            continue
        out += [f"## Ops inside the forward: {r['label']}", "",
                f"Eager forward {o['eager_forward_ms']:.2f} ms/step ({o['native_ms']:.2f} ms in native ops, so "
                f"{max(0.0, o['eager_forward_ms'] - o['native_ms']):.2f} ms Python dispatch); the replay's forward "
                f"{r['phases_ms']['forward']:.2f} ms split by the eager native shares.", ""]
        out.append(C.md_table(["op", "calls / step", "eager self ms", "share", "scaled to replay ms"],
                              [[x["op"], f"{x['calls_per_step']:.0f}", f"{x['self_ms_per_step']:.3f}",
                                f"{x['share_of_native']:.2f}", f"{x['scaled_ms_per_step']:.3f}"] for x in o["ops"]]))
        out.append("")
    return "\n".join(out)


def run_ab(args, argv: list[str]) -> None:
    """Interleaved before/after: rounds of (baseline checkout, this checkout), each a fresh process with
    --repeats 1 and no op profile; per arm and phase the median over rounds of the per-run means."""
    import json
    import subprocess
    import sys

    tag = args.tag or args.model_size
    flags = ("--ab-baseline", args.ab_baseline, "--ab-candidate", args.ab_candidate, "--rounds", str(args.rounds))
    base = [a for a in argv if a not in flags]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for rnd in range(args.rounds):
        for arm in ("before", "after"):
            src = args.ab_baseline if arm == "before" else args.ab_candidate
            extra = ["--pagellm-src", src] if src else []
            cmd = [sys.executable, __file__, *base, "--no-ops", "--repeats", "1", "--tag", f"{tag}_ab_{arm}", *extra]
            print(f"[ab] round {rnd} {arm}", flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            runs[arm].append(json.loads((C.RESULTS_DIR / f"step_profile_{tag}_ab_{arm}.json").read_text()))
    for arm in runs:  # only the merged result is kept
        for ext in ("md", "json"):
            (C.RESULTS_DIR / f"step_profile_{tag}_ab_{arm}.{ext}").unlink(missing_ok=True)
    labels = [r["label"] for r in runs["after"][0]["results"]]
    headers = ["phase"] + [f"{lab} {arm}" for lab in labels for arm in ("before", "after")]

    def med(arm: str, i: int, get) -> float:
        return statistics.median(get(d["results"][i]) for d in runs[arm])
    rows = [[p] + [f"{med(arm, i, lambda r: r['phases_ms'][p]):.3f}" for i in range(len(labels))
                   for arm in ("before", "after")] for p in PHASES]
    for name, get in (("**step (TPOT)**", lambda r: r["tpot_ms"]), ("median step", lambda r: r["median_step_ms"]),
                      ("fixed (TPOT - forward - LM head)", lambda r: r["fixed_ms"]), ("MBU step", lambda r: r["mbu_step"])):
        rows.append([name] + [f"{med(arm, i, get):.3f}" for i in range(len(labels)) for arm in ("before", "after")])
    loads = [d["load"][0] for arm in runs for d in runs[arm]]
    md = "\n".join([f"# Batch-1 step profile, before / after ({tag})", "",
                    f"{args.rounds} rounds of (before: {args.ab_baseline}, after: {args.ab_candidate or 'this checkout'}), each a fresh "
                    f"process, {args.output_len} new tokens after a {args.prompt_len}-token prompt; median over "
                    f"rounds of each run's mean per step (ms). 1-min load at the runs' starts: "
                    f"{min(loads):.1f}-{max(loads):.1f}.", "", C.md_table(headers, rows)])
    print("\n" + md)
    C.save_results(f"step_profile_{tag}_ab", md, {"tag": tag, "env": C.env_info(), "rounds": runs})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", choices=["default", "1b"], default="default")
    ap.add_argument("--dtypes", default=None, help="comma list (default: bfloat16,float32; 1b: bfloat16)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=10, help="op kinds listed before the rest are summed")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-detokenize", action="store_true")
    ap.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy",
                    help="what each request asks of the sampler (sampled: temperature 0.8, top-p 0.95, top-k 50, "
                         "seeded; -lp: 5 logprobs)")
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together (max_num_seqs)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: phases and steps in the calling thread's CPU time (a busy shared machine)")
    ap.add_argument("--no-ops", action="store_true", help="skip the torch.profiler split of the forward")
    ap.add_argument("--pagellm-src", default=None,
                    help="import pagellm from this python/ dir instead (another checkout with its built _C, for "
                         "before/after runs of engine changes)")
    ap.add_argument("--ab-baseline", default=None, metavar="DIR",
                    help="interleaved before/after: --pagellm-src DIR (before) vs this checkout (after), --rounds times")
    ap.add_argument("--ab-candidate", default=None, metavar="DIR",
                    help="the after arm from this dir too (both arms then share one _C build)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args()
    if args.ab_baseline:
        import sys

        return run_ab(args, sys.argv[1:])
    if args.pagellm_src:
        use_pagellm_from(args.pagellm_src)
    if args.quick:
        args.output_len, args.repeats = 32, 1
    dtypes = (args.dtypes or ("bfloat16" if args.model_size == "1b" else "bfloat16,float32")).split(",")
    C.setup_threads(args.threads)
    tok, _ = C.load_tokenizer_for_prompts()
    pool = C.doc_token_pool(tok, max_chars=200_000)
    prompt = [t % 32000 for t in pool[1000:1000 + args.prompt_len]]  # valid for both vocabularies
    load = C.loadavg()
    bw = C.copy_bandwidth_gbs()
    rbw = C.read_bandwidth_gbs()
    print(f"[bw] copy {bw['best_gbs']:.1f} GB/s best, read-only {rbw['best_gbs']:.1f} GB/s best; load {load}",
          flush=True)
    results = [measure(f"{args.model_size}:{d}", args, prompt, bw["best_gbs"]) for d in dtypes]
    for r in results:  # the same bytes over the read-only ceiling
        r["mbu_forward_read"] = r["bytes_per_token"] / (r["forward_ms"] / 1e3) / 1e9 / rbw["best_gbs"]
        r["mbu_step_read"] = r["bytes_per_token"] / (r["tpot_ms"] / 1e3) / 1e9 / rbw["best_gbs"]
    tag = args.tag or args.model_size
    data = {"tag": tag, "env": C.env_info(), "load": load, "bandwidth": bw, "read_bandwidth": rbw,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len, "repeats": args.repeats, "no_detokenize": args.no_detokenize,
            "sampling": args.sampling, "batch": args.batch, "clock": args.clock,
            "results": results}
    md = render(data)
    print("\n" + md)
    C.save_results(f"step_profile_{tag}", md, data)


if __name__ == "__main__":
    main()
