#!/usr/bin/env python
"""Where offline throughput's time goes (issue 22): the default model in bf16, N x (prompt -> output), as in
bench_peers.py --throughput, split into prefill steps (steps that schedule prompt tokens) and decode-only steps.

    python benchmarks/bench_batch_profile.py                    # 64 x (128 -> 64), step graph on, then eager ops
    python benchmarks/bench_batch_profile.py --no-ops           # step timing only
    python benchmarks/bench_batch_profile.py --max-num-batched-tokens 4096

Part 1 (the run as users see it): engine.step() wall time per step kind, with the scheduled token/row counts,
the process CPU time (all threads; with PAGELLM_NUM_THREADS=1 the work itself, a steadier A/B figure on a busy
machine than wall time), the cores that used (CPU s / wall s: ~2 when both threads of a 2-core pool work, ~1 when
the pool ran on the caller alone), the thread pool's stalls in those steps (regions after which it ran regions on
the caller alone for 5-200 ms: a worker was preempted), the process's minor page faults (memory the allocator
mapped afresh: PAGELLM_RETAIN_HEAP) and the forward / LM head / sampler share of each
(instance-level timers around the runner's functions).
With --pool-profile the timed run also keeps the thread pool's per-region accounting (`_C.set_thread_pool_profiling`):
per step kind and region body (kernel), the regions split across the threads and those run on the caller alone,
their wall time, each side's busy time inside the chunks, the caller's wait for the workers' chunks and the workers'
join delay, and the step time outside every region (the host's serial part, when the workers spin or sleep).
Part 2 (where inside the forward): the same workload with the step graph off under torch.profiler, native self
time per op kind, separately for prefill steps and decode-only steps. Writes results/batch_profile_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections import defaultdict

import common as C
import torch


def timed(store: dict, key: str, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            store[key] += time.perf_counter() - t
    return wrapper


def add_requests(eng, reqs: list[C.Request], tag: str) -> None:
    from pagellm import SamplingParams

    for i, r in enumerate(reqs):
        sp = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0, detokenize=False)
        eng.add_request(f"{tag}-{i}", {"prompt_token_ids": r.prompt_token_ids}, sp)


def step_kinds(eng) -> tuple[str, int, int]:
    """Wraps scheduler.schedule to remember what the next step runs: (kind, tokens, rows)."""
    seen = {}
    sched = eng.scheduler
    schedule = sched.schedule

    def spy():
        out = schedule()
        n_tok = int(sum(out.num_scheduled_tokens)) if len(out.request_ids) else 0
        rows = len(out.request_ids)
        seen["last"] = ("prefill" if n_tok > rows else "decode", n_tok, rows)
        return out
    eng.scheduler = type("Spy", (), {"__getattr__": lambda self, k: getattr(sched, k), "schedule": staticmethod(spy)})()
    return seen


def kernel_name(lib: str, offset: int) -> str:
    """The kernel a region body belongs to: addr2line on the body's trampoline, shortened to the function whose
    lambda it runs (pagellm::parallel_for<...kernel(...)::{lambda...}>)."""
    import re
    import subprocess

    if not lib:
        return f"0x{offset:x}"
    from pathlib import Path

    # the installed libraries are stripped: the build tree's copies (same code) keep the symbols
    unstripped = sorted((Path(__file__).resolve().parents[1] / "build").glob(f"*/{Path(lib).name}"))
    lib = str(unstripped[0]) if unstripped else lib
    try:
        fn = subprocess.run(["addr2line", "-f", "-C", "-e", lib, f"0x{offset:x}"], capture_output=True, text=True,
                            timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return f"{lib.rsplit('/', 1)[-1]}+0x{offset:x}"
    if fn.startswith("_Z"):  # a lambda addr2line could not demangle: the first length-prefixed name of a kernel
        names, i = [], 0
        while (m := re.compile(r"(\d+)([A-Za-z_])").search(fn, i)):
            n = int(m.group(1))
            names.append(fn[m.start(2):m.start(2) + n])
            i = m.start(2) + n
        kernels = [n for n in names if n.endswith("_kernel") or n.startswith("paged_attention")]
        return kernels[0] if kernels else fn[:60]
    inner = fn.split("parallel_for<", 1)[-1]
    inner = inner.split("::{lambda", 1)[0]
    depth, cut = 0, len(inner)  # drop the trailing (argument list) of the enclosing function
    for i in range(len(inner) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(inner[i], 0)
        if depth == 0 and inner[i] == "(":
            cut = i
            break
    name = re.sub(r"<[^<>]*>", "", re.sub(r"<[^<>]*>", "", inner[:cut]))
    return name.split(" ")[-1].replace("pagellm::", "").replace("(anonymous namespace)::", "")


def add_pool_profile(acc: dict, prof: dict, step_s: float) -> None:
    acc["steps"] += 1
    acc["step_ns"] += step_s * 1e9
    for k in ("worker_spin_ns", "worker_sleeps", "wakes"):
        acc[k] += prof[k]
    for site in prof["sites"]:
        a = acc["sites"].setdefault((site["lib"], site["offset"]), defaultdict(int))
        for k, v in site.items():
            if k not in ("lib", "offset"):
                a[k] += v


def pool_profile_table(acc: dict) -> list[str]:
    """Per kernel: ms a step of split-region wall, caller / worker busy, caller wait, solo wall; and the totals."""
    n = max(acc["steps"], 1)
    ms = lambda ns: round(ns / n / 1e6, 3)  # noqa: E731
    named: dict[str, dict] = {}
    for (lib, off), a in acc["sites"].items():
        d = named.setdefault(kernel_name(lib, off), defaultdict(int))
        for k, v in a.items():
            d[k] += v
    rows, tot = [], defaultdict(int)
    for name, a in sorted(named.items(), key=lambda kv: -(kv[1]["wall_ns"] + kv[1]["solo_ns"])):
        for k, v in a.items():
            tot[k] += v
        busy = a["caller_busy_ns"] + a["worker_busy_ns"]
        rows.append([name, round(a["regions"] / n, 1), round(a["solo_regions"] / n, 1), ms(a["wall_ns"]),
                     ms(a["caller_busy_ns"]), ms(a["worker_busy_ns"]), ms(a["caller_wait_ns"]),
                     round(a["worker_join_ns"] / max(a["regions"] - a["worker_missed"], 1) / 1e3, 1),
                     a["worker_missed"], f"{busy / max(2 * a['wall_ns'], 1) * 100:.0f} %", ms(a["solo_ns"])])
    busy = tot["caller_busy_ns"] + tot["worker_busy_ns"]
    rows.append(["**all**", round(tot["regions"] / n, 1), round(tot["solo_regions"] / n, 1), ms(tot["wall_ns"]),
                 ms(tot["caller_busy_ns"]), ms(tot["worker_busy_ns"]), ms(tot["caller_wait_ns"]),
                 round(tot["worker_join_ns"] / max(tot["regions"] - tot["worker_missed"], 1) / 1e3, 1),
                 tot["worker_missed"], f"{busy / max(2 * tot['wall_ns'], 1) * 100:.0f} %", ms(tot["solo_ns"])])
    outside = acc["step_ns"] - tot["wall_ns"] - tot["solo_ns"]
    return [C.md_table(["kernel", "split/step", "solo/step", "split wall ms", "caller busy ms", "worker busy ms",
                        "caller wait ms", "worker join us", "regions no worker ran", "busy / 2 wall", "solo ms"], rows),
            "", f"Per step: {ms(acc['step_ns'])} ms wall, {ms(tot['wall_ns'])} in split regions, "
                f"{ms(tot['solo_ns'])} in solo regions, {ms(outside)} outside every region (host); workers spun "
                f"{ms(acc['worker_spin_ns'])} ms, slept {acc['worker_sleeps'] / n:.1f} times, woken by "
                f"{acc['wakes'] / n:.1f} regions."]


def run_timed(llm, reqs: list[C.Request], pool_profile: bool = False) -> dict:
    eng = llm.llm_engine
    runner = eng.runner
    secs: dict[str, float] = defaultdict(float)
    saved_sched = eng.scheduler
    seen = step_kinds(eng)
    runner._decode_with_graph = timed(secs, "forward", runner._decode_with_graph)
    runner._forward = timed(secs, "forward", runner._forward)
    runner.model.compute_logits = timed(secs, "LM head", runner.model.compute_logits)
    greedy_head = getattr(runner.model, "compute_greedy_token_ids", None)
    if greedy_head is not None:  # plain-greedy steps: the LM head with its argmax fused (linear_argmax)
        runner.model.compute_greedy_token_ids = timed(secs, "LM head", greedy_head)
    eng._sample = timed(secs, "sampler", eng._sample)
    from pagellm import _C

    def pool_stalls() -> int:  # regions after which the pool ran on the caller alone (a preempted worker)
        return _C.thread_pool_info()["num_stalls"]
    steps = []
    pool_acc = {k: {"steps": 0, "step_ns": 0.0, "worker_spin_ns": 0, "worker_sleeps": 0, "wakes": 0, "sites": {}}
                for k in ("prefill", "decode")}
    add_requests(eng, reqs, f"t{time.time_ns()}")
    t0 = time.perf_counter()
    try:
        while eng.has_unfinished_requests():
            before = dict(secs)
            if pool_profile:
                _C.set_thread_pool_profiling(True)
            t, c, st = time.perf_counter(), time.process_time(), pool_stalls()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            eng.step()
            dt, dc = time.perf_counter() - t, time.process_time() - c
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            kind, n_tok, rows = seen["last"]
            if pool_profile:
                add_pool_profile(pool_acc[kind], _C.thread_pool_profile(), dt)
            steps.append({"kind": kind, "tokens": n_tok, "rows": rows, "s": dt, "cpu_s": dc, "stalls": pool_stalls() - st,
                          "faults": faults,
                          **{k: secs[k] - before.get(k, 0.0) for k in ("forward", "LM head", "sampler")}})
    finally:
        if pool_profile:
            _C.set_thread_pool_profiling(False)
        eng.scheduler = saved_sched
        for k in ("_decode_with_graph", "_forward"):
            runner.__dict__.pop(k, None)
        runner.model.__dict__.pop("compute_logits", None)
        runner.model.__dict__.pop("compute_greedy_token_ids", None)
        eng.__dict__.pop("_sample", None)
    total = time.perf_counter() - t0
    out = {"elapsed_s": total, "output_tok_s": sum(r.output_len for r in reqs) / total, "kinds": {},
           "step_kinds": [s["kind"] for s in steps]}
    if pool_profile:
        out["pool_profile"] = {k: pool_profile_table(a) for k, a in pool_acc.items() if a["steps"]}
    for kind in ("prefill", "decode"):
        ks = [s for s in steps if s["kind"] == kind]
        if not ks:
            continue
        out["kinds"][kind] = {
            "steps": len(ks), "total_s": sum(s["s"] for s in ks), "cpu_s": sum(s["cpu_s"] for s in ks),
            "pool_stalls": sum(s["stalls"] for s in ks), "minor_faults": sum(s["faults"] for s in ks),
            "median_step_ms": statistics.median(s["s"] for s in ks) * 1e3,
            "tokens_per_step": statistics.median(s["tokens"] for s in ks), "rows_per_step": statistics.median(s["rows"] for s in ks),
            **{f"{k}_s": sum(s[k] for s in ks) for k in ("forward", "LM head", "sampler")}}
    return out


def run_profiled(llm, reqs: list[C.Request], kinds: list[str], top: int) -> dict:
    """The same workload eagerly under torch.profiler (one profile per step), self CPU time per op, summed per
    step kind. The schedule is deterministic, so step i has the kind it had in the timed run (`kinds`)."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.llm_engine
    runner = eng.runner
    graphs, runner.step_graphs = runner.step_graphs, None
    acc: dict[str, dict] = {k: {"steps": 0, "wall_s": 0.0, "ops": defaultdict(lambda: [0, 0.0])} for k in ("prefill", "decode")}
    try:
        eng.reset_prefix_cache()  # the timed run cached these prompts: prefill them again
        add_requests(eng, reqs, f"p{time.time_ns()}")
        i = 0
        while eng.has_unfinished_requests():
            a = acc[kinds[min(i, len(kinds) - 1)]]
            with profile(activities=[ProfilerActivity.CPU]) as p:
                t = time.perf_counter()
                eng.step()
                a["wall_s"] += time.perf_counter() - t
            for e in p.key_averages():
                if e.key.startswith(("aten::", "pagellm::")):
                    a["ops"][e.key][0] += e.count
                    a["ops"][e.key][1] += e.self_cpu_time_total / 1e6
            a["steps"] += 1
            i += 1
    finally:
        runner.step_graphs = graphs
    tables = {}
    for kind, a in acc.items():
        if not a["steps"]:
            continue
        n = a["steps"]
        ops = sorted(a["ops"].items(), key=lambda kv: kv[1][1], reverse=True)
        rows = [{"op": k, "calls_per_step": c / n, "self_ms_per_step": s / n * 1e3, "share": s / a["wall_s"]}
                for k, (c, s) in ops[:top]]
        tables[kind] = {"steps": n, "wall_s": a["wall_s"], "native_s": sum(s for _, (_, s) in ops), "ops": rows}
    return tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--no-ops", action="store_true", help="skip the eager torch.profiler pass")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--tag", default="local")
    ap.add_argument("--pagellm-src", default=None, help="import pagellm from this python/ dir (a base build, A/B)")
    ap.add_argument("--pool-profile", action="store_true", help="the thread pool's per-region accounting, per kernel")
    args = ap.parse_args()
    if args.pagellm_src:
        from bench_step_profile import use_pagellm_from

        use_pagellm_from(args.pagellm_src)
    from bench_throughput import warmup_pagellm

    tok, _ = C.load_tokenizer_for_prompts()
    pool = C.doc_token_pool(tok, max_chars=200_000)
    reqs = [C.Request(pool[i * 200:i * 200 + args.prompt_len], args.output_len) for i in range(args.num_requests)]
    kw = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    llm = C.make_llm("smollm2-135m", max_model_len=args.prompt_len + args.output_len + 16,
                     max_num_seqs=args.num_requests, kv_gb=1.0, **kw)
    warmup_pagellm(llm, pool)
    la0 = C.loadavg()
    timing = run_timed(llm, reqs, args.pool_profile)
    data = {"args": vars(args), "loadavg_before": la0, "loadavg_after": C.loadavg(), "timing": timing,
            "threads": torch.get_num_threads()}
    lines = [f"# Batch profile: {args.num_requests} x ({args.prompt_len} -> {args.output_len}), bf16, "
             f"max_num_batched_tokens {llm.llm_engine.config.scheduler_config.max_num_batched_tokens}",
             "", f"Load {la0} -> {data['loadavg_after']}; {timing['elapsed_s']:.2f} s, {timing['output_tok_s']:.1f} out tok/s",
             "", C.md_table(["steps", "count", "tokens/step", "rows/step", "total s", "process CPU s", "cores used",
                             "pool stalls", "minor faults", "median step ms", "forward s", "LM head s", "sampler s", "rest s"],
                            [[k, v["steps"], v["tokens_per_step"], v["rows_per_step"], round(v["total_s"], 3),
                              round(v["cpu_s"], 3), round(v["cpu_s"] / v["total_s"], 2), v["pool_stalls"], v["minor_faults"],
                              round(v["median_step_ms"], 2), round(v["forward_s"], 3), round(v["LM head_s"], 3),
                              round(v["sampler_s"], 3), round(v["total_s"] - v["forward_s"] - v["LM head_s"] - v["sampler_s"], 3)]
                             for k, v in timing["kinds"].items()])]
    for kind, table in timing.get("pool_profile", {}).items():
        lines += ["", f"Thread pool, {kind} steps (per step; `busy / 2 wall`: both threads' chunk time over twice the "
                      "regions' wall time):", "", *table]
    print("\n".join(lines), flush=True)
    if not args.no_ops:
        data["ops"] = run_profiled(llm, reqs, timing["step_kinds"], args.top)
        for kind, t in data["ops"].items():
            part = ["", f"Eager {kind} steps under torch.profiler: {t['steps']} steps, {t['wall_s']:.2f} s wall, "
                        f"{t['native_s']:.2f} s native self time", "",
                    C.md_table(["op", "calls/step", "self ms/step", "share of wall"],
                               [[r["op"], round(r["calls_per_step"], 1), round(r["self_ms_per_step"], 2),
                                 f"{r['share'] * 100:.1f} %"] for r in t["ops"]])]
            print("\n".join(part), flush=True)
            lines += part
    C.save_results(f"batch_profile_{args.tag}", "\n".join(lines) + "\n", data)


if __name__ == "__main__":
    main()
