#!/usr/bin/env python
"""Batch-1 latency: TTFT, TPOT and decode MBU of pagellm (streamed through LLMEngine.add_request /
step), HF transformers' batch-1 TTFT/TPOT on the same weights, and a profile of one decode step.

    python benchmarks/bench_latency.py                 # both models, prompt 256, 128 new tokens, profile
    python benchmarks/bench_latency.py --quick
    python benchmarks/bench_latency.py --models smollm2-135m --prompt-len 512 --output-len 256

MBU = (weight bytes + KV bytes read per decode token) / TPOT / copy bandwidth, where the copy
bandwidth is a large tensor.copy_ measured in the same run (read + write bytes / time) and the KV
bytes use the mean context length over the decode. Weight bytes: every unique parameter once (a
tied embedding counts once, as the LM head reads it whole; an untied input embedding counts one row).
Writes benchmarks/results/latency_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict

import common as C
import torch


class _Timer:
    def __init__(self):
        self.t = defaultdict(float)
        self.n = defaultdict(int)

    def wrap(self, key, fn):
        def f(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[key] += time.perf_counter() - t
                self.n[key] += 1
        return f


class _ModelProxy:
    """Stands in for runner.model: times forward and compute_logits, delegates the rest."""

    def __init__(self, model, timer):
        self._m, self._timer = model, timer
        self.compute_logits = timer.wrap("compute_logits (LM head)", model.compute_logits)

    def __call__(self, *a, **k):
        return self._timer.wrap("model forward (decoder layers)", self._m)(*a, **k)

    def __getattr__(self, name):
        return getattr(self._m, name)


def stream_one(eng, prompt: list[int], n_out: int, rid: str, on_step=None) -> dict:
    """add_request + step() until done; times of the first token and of each later token."""
    from pagellm import SamplingParams

    sp = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0, detokenize=False)
    t0 = time.perf_counter()
    eng.add_request(rid, {"prompt_token_ids": prompt}, sp)
    times, seen = [], 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            times.extend([now] * (n - seen))
            seen = n
        if on_step is not None:
            on_step()
    assert seen == n_out, (seen, n_out)
    itl = [b - a for a, b in zip(times, times[1:])]
    return {"ttft_ms": (times[0] - t0) * 1e3, "tpot_ms": (times[-1] - times[0]) / (n_out - 1) * 1e3,
            "itl_median_ms": statistics.median(itl) * 1e3, "itl_p90_ms": sorted(itl)[int(0.9 * (len(itl) - 1))] * 1e3}


def profile_decode(eng, prompt: list[int], n_out: int, top: int) -> dict:
    """(1) wall-time split of engine.step() at batch 1 (instance-level wrappers, engine code untouched),
    (2) torch.profiler: top ops by self CPU time over the decode steps, native-op share of the wall time."""
    from torch.profiler import ProfilerActivity, profile

    timer = _Timer()
    runner = eng.runner
    orig_model, orig_exec, orig_sampler = runner.model, runner.execute, eng.sampler
    orig_sched = eng.scheduler
    runner.model = _ModelProxy(orig_model, timer)
    runner.execute = timer.wrap("runner.execute (total)", orig_exec)
    eng.sampler = timer.wrap("sampler", orig_sampler)
    eng_step = eng.step
    try:
        # wall split (no profiler): prefill excluded by resetting after the first token
        from pagellm import SamplingParams

        sp = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0, detokenize=False)
        eng.add_request("prof-split", {"prompt_token_ids": prompt}, sp)
        eng_step()  # prefill
        timer.t.clear(), timer.n.clear()
        steps, t0 = 0, time.perf_counter()
        while eng.has_unfinished_requests():
            eng_step()
            steps += 1
        wall = time.perf_counter() - t0
        split = {k: {"ms_per_step": v / steps * 1e3, "share": v / wall} for k, v in timer.t.items()}
        split["engine.step (total)"] = {"ms_per_step": wall / steps * 1e3, "share": 1.0}
        ex = timer.t["runner.execute (total)"]
        fw = timer.t["model forward (decoder layers)"] + timer.t["compute_logits (LM head)"]
        other = wall - ex - timer.t["sampler"]
        split["runner.execute minus model (metadata, plan, tensors)"] = {"ms_per_step": (ex - fw) / steps * 1e3,
                                                                           "share": (ex - fw) / wall}
        split["rest of step (scheduler, sampling metadata, output processing)"] = {
            "ms_per_step": other / steps * 1e3, "share": other / wall}
    finally:
        runner.model, runner.execute, eng.sampler = orig_model, orig_exec, orig_sampler
    assert eng.scheduler is orig_sched

    # torch.profiler over the decode steps
    eng.add_request("prof-ops", {"prompt_token_ids": prompt}, sp)
    eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        steps, t0 = 0, time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        pwall = time.perf_counter() - t0
    ka = prof.key_averages()
    rows = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)
    total_self_us = sum(e.self_cpu_time_total for e in ka)
    top_rows = [{"op": e.key, "calls_per_step": e.count / steps, "self_ms_per_step": e.self_cpu_time_total / steps / 1e3,
                 "share_of_wall": e.self_cpu_time_total / 1e6 / pwall} for e in rows[:top]]
    return {"steps": steps, "split": split, "profiler_wall_ms_per_step": pwall / steps * 1e3,
            "native_ops_ms_per_step": total_self_us / steps / 1e3, "native_ops_share": total_self_us / 1e6 / pwall,
            "num_op_calls_per_step": sum(e.count for e in ka) / steps, "top_ops": top_rows}


def bench_model(name: str, args, pool, bw_gbs: float) -> dict:
    print(f"\n=== {name} ===", flush=True)
    prompt = pool[1000:1000 + args.prompt_len]
    llm = C.make_llm(name, max_model_len=args.prompt_len + args.output_len + 16, max_num_seqs=1, kv_gb=0.5)
    eng = llm.llm_engine
    info = C.model_bytes_per_decode_token(eng.model, eng.model_files.hf_config)
    stream_one(eng, pool[:64], 8, "warm")
    runs = []
    for i in range(args.repeats):
        eng.reset_prefix_cache()
        r = stream_one(eng, prompt, args.output_len, f"lat{i}")
        runs.append(r)
        print(f"[pagellm] run {i}: TTFT {r['ttft_ms']:.1f} ms  TPOT {r['tpot_ms']:.2f} ms  "
              f"ITL p50 {r['itl_median_ms']:.2f} ms", flush=True)
    ttft = statistics.median(r["ttft_ms"] for r in runs)
    tpot = statistics.median(r["tpot_ms"] for r in runs)
    best_tpot = min(r["tpot_ms"] for r in runs)
    mean_ctx = args.prompt_len + (args.output_len - 1) / 2
    bytes_tok = info["weight_bytes"] + info["kv_bytes_per_ctx_token"] * mean_ctx
    res = {"model": name, "num_params": info["num_params"], "weight_bytes": info["weight_bytes"],
           "kv_bytes_per_ctx_token": info["kv_bytes_per_ctx_token"], "mean_ctx": mean_ctx,
           "bytes_per_decode_token": bytes_tok, "runs": runs, "ttft_ms": ttft, "tpot_ms": tpot,
           "best_tpot_ms": best_tpot, "achieved_gbs": bytes_tok / (tpot / 1e3) / 1e9,
           "mbu": bytes_tok / (tpot / 1e3) / 1e9 / bw_gbs, "mbu_best_run": bytes_tok / (best_tpot / 1e3) / 1e9 / bw_gbs,
           "attention_backend": type(eng.attn_backend).__name__}
    # pure model forward at batch 1 (no engine): lower bound for what the engine step can reach
    print(f"[pagellm] TTFT {ttft:.1f} ms  TPOT {tpot:.2f} ms  {res['achieved_gbs']:.1f} GB/s  MBU {res['mbu']:.2f}",
          flush=True)
    if args.profile and name in args.profile_models:
        eng.reset_prefix_cache()
        res["profile"] = profile_decode(eng, prompt, args.profile_steps, args.top)
        p = res["profile"]
        print(f"[profile] step {p['split']['engine.step (total)']['ms_per_step']:.2f} ms; native ops "
              f"{p['native_ops_share']:.0%} of profiled wall", flush=True)
    hf_path = eng.model_files.path
    del llm, eng
    gc.collect()
    if not args.no_hf:
        hf = C.load_hf(hf_path)
        C.hf_generate_batch(hf, [pool[:32]], 4)
        h = C.hf_batch1_latency(hf, prompt, args.hf_output_len, repeats=args.hf_repeats)
        h["mbu"] = bytes_tok / (h["tpot_ms"] / 1e3) / 1e9 / bw_gbs
        res["hf"] = h
        res["tpot_speedup_vs_hf"] = h["tpot_ms"] / tpot
        res["ttft_speedup_vs_hf"] = h["ttft_ms"] / ttft
        print(f"[hf] TTFT {h['ttft_ms']:.1f} ms  TPOT {h['tpot_ms']:.2f} ms", flush=True)
        del hf
        gc.collect()
    return res


def render(data: dict) -> str:
    e, bw = data["env"], data["copy_bandwidth"]
    out = [f"# Batch-1 latency ({data['tag']})", "",
           f"{e['time']}, {e['cpu']}, {e['nproc']} cores, torch {e['torch']} ({e['torch_threads']} threads), "
           f"transformers {e['transformers']}, git {e['git_head']}. Load average before measuring: "
           f"{tuple(round(x, 2) for x in data['load']['load_at_start'])} (waited {data['load']['waited_s']} s, "
           f"below threshold: {data['load']['load_ok']}); at end {tuple(round(x, 2) for x in data['load_at_end'])}.", "",
           f"Prompt {data['args']['prompt_len']} tokens (python3.11-doc), {data['args']['output_len']} new tokens, "
           f"greedy, bf16, median of {data['args']['repeats']} runs streamed through LLMEngine.step(). "
           f"Copy bandwidth (tensor.copy_ of {bw['bytes'] >> 20} MiB, read+write): best {bw['best_gbs']:.1f} GB/s, "
           f"median {bw['median_gbs']:.1f} GB/s; MBU uses the best. HF: generate() batch 1, TPOT = "
           f"(t({data['args']['hf_output_len']} tokens) - t(1 token)) / {data['args']['hf_output_len'] - 1}.", ""]
    rows = []
    for m in data["models"]:
        h = m.get("hf", {})
        rows.append([m["model"], f"{m['weight_bytes'] / 1e6:.0f} MB", f"{m['bytes_per_decode_token'] / 1e6:.0f} MB",
                     m["ttft_ms"], m["tpot_ms"], m["achieved_gbs"], f"{m['mbu']:.2f}",
                     h.get("ttft_ms", ""), h.get("tpot_ms", ""), f"{h['mbu']:.2f}" if h else "",
                     f"{m['tpot_speedup_vs_hf']:.2f}x" if h else ""])
    out.append(C.md_table(["model", "weights", "bytes/decode tok", "pagellm TTFT ms", "pagellm TPOT ms",
                           "achieved GB/s", "pagellm MBU", "HF TTFT ms", "HF TPOT ms", "HF MBU",
                           "TPOT speedup vs HF"], rows))
    for m in data["models"]:
        p = m.get("profile")
        if not p:
            continue
        out += ["", f"## Where batch-1 decode time goes ({m['model']}, {p['steps']} decode steps)", "",
                "Wall-time split of `engine.step()` (instance wrappers, no profiler):", "",
                C.md_table(["part", "ms / step", "share of step"],
                           [[k, v["ms_per_step"], f"{v['share']:.0%}"] for k, v in p["split"].items()]),
                "", f"torch.profiler: {p['num_op_calls_per_step']:.0f} op calls per step; native ops' self time "
                    f"{p['native_ops_ms_per_step']:.2f} ms of {p['profiler_wall_ms_per_step']:.2f} ms wall per step "
                    f"({p['native_ops_share']:.0%}; the rest is Python / dispatch / profiler overhead). Top ops:", "",
                C.md_table(["op", "calls / step", "self ms / step", "share of wall"],
                           [[r["op"], round(r["calls_per_step"], 1), r["self_ms_per_step"], f"{r['share_of_wall']:.1%}"]
                            for r in p["top_ops"]])]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-0.5b-random"])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-output-len", type=int, default=32)
    ap.add_argument("--hf-repeats", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--profile-models", nargs="+", default=["smollm2-135m", "llama-0.5b-random"])
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--threads", default="auto",
                    help="torch threads; auto: torch's default if the load wait succeeded, else 1")
    ap.add_argument("--wait-load", type=float, default=2.5)
    ap.add_argument("--wait-timeout", type=float, default=900)
    ap.add_argument("--quick", action="store_true", help="prompt 128, 32 new tokens, 1 run, HF 8 tokens")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.output_len, args.repeats, args.hf_output_len, args.hf_repeats = 128, 32, 1, 8, 1
        args.profile_steps = 8
    tag = args.tag or ("quick" if args.quick else "full")
    tok, _ = C.load_tokenizer_for_prompts()
    pool = C.doc_token_pool(tok, max_chars=200_000)
    for m in args.models:
        C.model_path(m)
    load = C.wait_for_load(args.wait_load, args.wait_timeout) if args.wait_load > 0 else {
        "waited_s": 0, "load_ok": None, "load_at_start": C.loadavg()}
    C.setup_threads(1 if args.threads == "auto" and not load["load_ok"] else
                    (None if args.threads == "auto" else int(args.threads)))
    bw = C.copy_bandwidth_gbs()
    print(f"[bandwidth] copy_ {bw['best_gbs']:.1f} GB/s (read+write, best), median {bw['median_gbs']:.1f}", flush=True)
    data = {"tag": tag, "env": C.env_info(), "load": load, "copy_bandwidth": bw, "args": vars(args), "models": []}
    for m in args.models:
        data["models"].append(bench_model(m, args, pool, bw["best_gbs"]))
    bw2 = C.copy_bandwidth_gbs()
    data["copy_bandwidth_end"] = bw2
    data["load_at_end"] = C.loadavg()
    md = render(data)
    print("\n" + md, flush=True)
    C.save_results(f"latency_{tag}", md, data)


if __name__ == "__main__":
    main()
