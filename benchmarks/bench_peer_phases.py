#!/usr/bin/env python
"""Offline throughput split into its two phases, pagellm bf16 vs vLLM-CPU bf16 in one run (issue 22).

    python benchmarks/bench_peer_phases.py --rounds 3
    python benchmarks/bench_peer_phases.py --systems pagellm --rounds 1     # without the peer

N x (prompt -> 1 token) times the prefill (every prompt, one sampled token); N x (prompt -> out) the whole run
(as `bench_peers.py --throughput`); (whole - prefill) / (out - 1) is a decode step at N rows. Each round runs
both lengths on every system back to back (pagellm, then vLLM), prefix caching off / reset, so their rounds
interleave; the table reports medians. Tells in which phase a gap to vLLM-CPU lies (its settings are logged in
.peers/vllm-cpu/driver_<tag>.log: max_num_batched_tokens, compilation). Writes results/peer_phases_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics

import common as C


def pagellm_runner(args, pool: list[int]):
    from bench_throughput import run_pagellm, warmup_pagellm

    llm = C.make_llm("smollm2-135m", max_model_len=args.prompt_len + args.output_len + 16,
                     max_num_seqs=args.num_requests, kv_gb=1.0)
    warmup_pagellm(llm, pool)

    def run(reqs: list[C.Request]) -> float:
        llm.llm_engine.reset_prefix_cache()  # every run prefills its prompts, as vLLM (no prefix caching) does
        return run_pagellm(llm, reqs)["elapsed_s"]
    return run, None


def vllm_runner(args):
    from pagellm.model_loader import open_model
    from peers import vllm_peer as V

    if not V.installed():
        raise RuntimeError(f"vLLM-CPU not installed (run: {V.SETUP_CMD})")
    log = V.VENV_PYTHON.parents[1] / f"driver_{args.tag}.log"
    drv = V.VllmDriver(str(open_model(None).path), args.threads_used, args.prompt_len + args.output_len + 16,
                       args.num_requests, log)

    def run(reqs: list[C.Request]) -> float:
        return drv.call({"cmd": "throughput", "prompts": [r.prompt_token_ids for r in reqs],
                         "n_out": reqs[0].output_len})["elapsed_s"]
    return run, drv.close


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="pagellm,vllm", help="comma list of pagellm, vllm")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="threads for every system (default: torch's)")
    ap.add_argument("--tag", default="run")
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = sorted(set(systems) - {"pagellm", "vllm"})
    if bad or args.output_len < 2 or args.rounds < 1:
        raise SystemExit(f"--systems from pagellm, vllm (got {bad}); --output-len >= 2; --rounds >= 1")
    args.threads_used = C.setup_threads(args.threads)
    tok, _ = C.load_tokenizer_for_prompts()
    pool = C.doc_token_pool(tok, max_chars=200_000)
    prompts = [pool[i * 200:i * 200 + args.prompt_len] for i in range(args.num_requests)]
    one = [C.Request(p, 1) for p in prompts]
    full = [C.Request(p, args.output_len) for p in prompts]
    runners = {}
    try:
        for name in systems:
            runners[name] = pagellm_runner(args, pool) if name == "pagellm" else vllm_runner(args)
        la0 = C.loadavg()
        times: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "full": []} for n in runners}
        for rnd in range(args.rounds):
            for name, (run, _) in runners.items():
                times[name]["prefill"].append(run(one))
                times[name]["full"].append(run(full))
                print(f"[round {rnd + 1}] {name}: prefill {times[name]['prefill'][-1]:.3f} s, "
                      f"full {times[name]['full'][-1]:.3f} s", flush=True)
    finally:
        for _, close in runners.values():
            if close:
                close()
    rows, data = [], {"args": vars(args), "env": C.env_info(), "loadavg_before": la0, "loadavg_after": C.loadavg(),
                      "systems": {}}
    base = None
    for name, t in times.items():
        pre, whole = statistics.median(t["prefill"]), statistics.median(t["full"])
        step_ms = (whole - pre) / (args.output_len - 1) * 1e3
        tok_s = args.num_requests * args.output_len / whole
        base = base or (pre, step_ms, tok_s)
        data["systems"][name] = {**t, "prefill_s": pre, "full_s": whole, "decode_step_ms": step_ms, "out_tok_s": tok_s}
        rows.append([name, round(pre, 3), round(step_ms, 2), round(whole, 3), round(tok_s, 1),
                     f"{pre / base[0]:.2f}x", f"{step_ms / base[1]:.2f}x", f"{tok_s / base[2]:.2f}x"])
    md = "\n".join([
        f"# Offline throughput by phase: {args.num_requests} x ({args.prompt_len} -> {args.output_len}), bf16, "
        f"{args.threads_used} threads, {args.rounds} interleaved rounds (medians)", "",
        f"Load {la0} -> {data['loadavg_after']}", "",
        C.md_table(["system", "prefill s (-> 1 token)", "decode step ms", "whole run s", "out tok/s",
                    "prefill / first", "step / first", "tok/s / first"], rows)])
    print(md, flush=True)
    C.save_results(f"peer_phases_{args.tag}", md + "\n", data)


if __name__ == "__main__":
    main()
