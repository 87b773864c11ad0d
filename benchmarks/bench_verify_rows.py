#!/usr/bin/env python
"""Batch-1 speculative decoding vs draft length on the copy prompts (issue 17, session 14): what a verify step of
1 + d query rows costs, and what ngram chains of k drafts gain, in one run.

    python benchmarks/bench_verify_rows.py                                   # rows 1..13, ngram k = 3,5,8,12
    python benchmarks/bench_verify_rows.py --rows 1,4,9,13 --ks 3,8 --rounds 2 --configs '{"ngram_match": {...}}'

Part 1, step cost vs rows: one engine (default model, bf16, max_num_seqs 1) decodes bench_spec_decode's copy prompts
with a proposer that always drafts d = rows - 1 tokens (copies of the last token: nearly always rejected, so every
step is a verify of exactly `rows` query rows and commits one token), adaptive switch off. rows = 1 is no
speculation. Each round runs every row count once on the same prompt (interleaved); per row count the median engine
step (wall and CPU time of this process) and its ratio to rows = 1 in the same round (median over rounds): the `c` of
a cost model "a verify of 1 + d rows costs 1 + c d plain steps" is (ratio - 1) / d.
Part 2, ngram vs k: `bench_spec_decode.run_batches` on the copy prompts at batch 1 for none and each ngram config
(prompt_lookup_min 1, max 4 by default; `--configs` adds speculative_configs as JSON, name -> dict with "{k}" in
num_speculative_tokens replaced), rounds interleaved: tokens/s and TPOT vs none, acceptance, mean accepted length.
Writes benchmarks/results/verify_rows_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import bench_spec_decode as S
import common as C


class FixedDrafts:
    """A proposer of exactly `num_drafts` drafts per sequence (the last token repeated): a verify of fixed size."""

    def __new__(cls, num_drafts: int):
        from pagellm.spec_decode import BaseProposer

        class _Fixed(BaseProposer):
            def propose(self, requests):
                return {r.seq_id: [r.output_token_ids[-1]] * r.max_num_drafts for r in requests}

        return _Fixed(num_drafts)


def step_costs(llm, prompts: list[list[int]], rows: list[int], rounds: int, steps: int) -> dict:
    from pagellm import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 1 + max(rows), ignore_eos=True, detokenize=False)
    per: dict[int, list[tuple[float, float]]] = {q: [] for q in rows}
    ratios: dict[int, list[tuple[float, float]]] = {q: [] for q in rows}
    for r in range(rounds + 1):  # round 0 warms up (graph capture per token count)
        prompt = prompts[r % len(prompts)]
        med = {}
        for q in rows:
            eng.set_proposer(None if q == 1 else FixedDrafts(q - 1), adaptive=False)
            eng.reset_prefix_cache()
            eng.add_request(f"r{r}-q{q}", {"prompt_token_ids": prompt}, sp)
            eng.step()  # prefill
            walls, cpus = [], []
            for _ in range(steps):
                w, c = time.perf_counter(), time.process_time()
                eng.step()
                walls.append(time.perf_counter() - w)
                cpus.append(time.process_time() - c)
            eng.abort_request(f"r{r}-q{q}")
            while eng.has_unfinished_requests():
                eng.step()
            med[q] = (statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3)
        if r == 0:
            continue
        for q in rows:
            per[q].append(med[q])
            ratios[q].append((med[q][0] / med[rows[0]][0], med[q][1] / med[rows[0]][1]))
        print(f"[rows round {r}] " + ", ".join(f"{q}: {med[q][0]:.2f}/{med[q][1]:.2f} ms" for q in rows), flush=True)
    return {q: {"wall_ms": statistics.median(x[0] for x in per[q]), "cpu_ms": statistics.median(x[1] for x in per[q]),
                "wall_ratio": statistics.median(x[0] for x in ratios[q]),
                "cpu_ratio": statistics.median(x[1] for x in ratios[q])} for q in rows}


def ngram_vs_k(prompts, configs: dict[str, dict | None], args) -> list[dict]:
    llms = {name: C.make_llm("default", max_model_len=max(map(len, prompts)) + args.output_len + 16, max_num_seqs=1,
                             kv_gb=0.3, speculative_config=spec) for name, spec in configs.items()}
    for llm in llms.values():
        S.run_batches(llm, prompts[-1:], 1, args.warmup_tokens)
    runs: dict[str, list[dict]] = {name: [] for name in llms}
    for r in range(args.rounds):
        for name, llm in llms.items():
            res = S.run_batches(llm, prompts, 1, args.output_len)
            runs[name].append(res)
            print(f"[k round {r}] {name}: {res['tok_s']:.1f} tok/s, TPOT {res['tpot_ms']:.2f} ms, acceptance "
                  f"{res['acceptance']:.2f}, mean len {res['mean_accepted_len']:.2f}", flush=True)
    base = runs["none"]
    out = []
    for name, rs in runs.items():
        out.append({"config": name, "tok_s": statistics.median(x["tok_s"] for x in rs),
                    "tpot_ms": statistics.median(x["tpot_ms"] for x in rs),
                    "ratio": statistics.median(x["tok_s"] / b["tok_s"] for x, b in zip(rs, base)),
                    "tpot_ratio": statistics.median(b["tpot_ms"] / x["tpot_ms"] for x, b in zip(rs, base)),
                    "cpu_ratio": statistics.median(x["tok_cpu_s"] / b["tok_cpu_s"] for x, b in zip(rs, base)),
                    "acceptance": statistics.median(x["acceptance"] for x in rs),
                    "mean_accepted_len": statistics.median(x["mean_accepted_len"] for x in rs),
                    "same_as_none": sum(a == b for x, bx in zip(rs, base) for a, b in zip(x["token_ids"], bx["token_ids"]))
                    / sum(len(x["token_ids"]) for x in rs)})
    return out


def render(data: dict) -> str:
    a, e = data["args"], data["env"]
    rows = [[q, f"{v['wall_ms']:.2f}", f"{v['cpu_ms']:.2f}", f"{v['wall_ratio']:.2f}x", f"{v['cpu_ratio']:.2f}x",
             "-" if int(q) == 1 else f"{(v['wall_ratio'] - 1) / (int(q) - 1):.3f}",
             "-" if int(q) == 1 else f"{(v['cpu_ratio'] - 1) / (int(q) - 1):.3f}"] for q, v in data["rows"].items()]
    ks = [[r["config"], f"{r['tok_s']:.1f}", f"{r['tpot_ms']:.2f}", f"{r['ratio']:.2f}x", f"{r['tpot_ratio']:.2f}x",
           f"{r['cpu_ratio']:.2f}x",
           "-" if r["config"] == "none" else f"{r['acceptance']:.2f}",
           "-" if r["config"] == "none" else f"{r['mean_accepted_len']:.2f}", f"{r['same_as_none']:.0%}"]
          for r in data["ks"]]
    return "\n".join([
        f"# Verify rows and draft length ({data['tag']})", "",
        f"{e['time']}, {e['cpu']}, {e['nproc']} cores, torch {e['torch']}, git {e['git_head']}, "
        f"PAGELLM_NUM_THREADS={a['num_threads_env']}; load average {data['load_start']} at start, {data['load_end']} "
        f"at end. Default model bf16, batch 1, copy prompts.", "",
        f"Step cost vs query rows ({a['rounds']} rounds after a warm-up round, {a['steps']} decode steps per row count "
        "and round, medians; c = (ratio - 1) / drafts):", "",
        C.md_table(["query rows", "step ms (wall)", "step ms (CPU)", "vs 1 row (wall)", "vs 1 row (CPU)", "c (wall)",
                    "c (CPU)"], rows),
        "", f"ngram vs k ({a['num_prompts']} prompts, {a['output_len']} new tokens, {a['rounds']} interleaved rounds, "
        "medians; tok/s and tokens per CPU second of this process include each request's prefill, TPOT does not):", "",
        C.md_table(["config", "tok/s", "TPOT ms", "tok/s vs none", "TPOT vs none", "tok per CPU s vs none",
                    "acceptance", "mean accepted len",
                    "same as none"], ks)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=list(range(1, 14)))
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per row count and round")
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[3, 5, 8, 12])
    ap.add_argument("--configs", type=json.loads, default={},
                    help='extra speculative_configs per k, e.g. \'{"match": {"method": "ngram", ...}}\'')
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--warmup-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-rows", action="store_true")
    ap.add_argument("--skip-ks", action="store_true", help="only part 1 (step cost vs rows)")
    ap.add_argument("--pagellm-src", default=None, help="import pagellm from this python/ dir (a 'before' build)")
    ap.add_argument("--tag", default="copy")
    ap.add_argument("--render", default=None, help="only re-render this results JSON (its .md beside it)")
    args = ap.parse_args()
    if args.render:
        data = json.loads(open(args.render).read())
        C.save_results(f"verify_rows_{data['tag']}", render(data), data)
        return
    if args.rows[0] != 1:
        ap.error("--rows must start with 1 (the plain step every ratio is taken against)")
    if args.pagellm_src:
        import bench_step_profile

        bench_step_profile.use_pagellm_from(args.pagellm_src)
    args.num_threads_env = os.environ.get("PAGELLM_NUM_THREADS", "unset (all CPUs)")
    tok, _ = C.load_tokenizer_for_prompts()
    prompts = S.workloads(tok, args.num_prompts)["copy"]
    load_start = tuple(round(x, 2) for x in C.loadavg())
    rows = {}
    if not args.skip_rows:
        llm = C.make_llm("default", max_model_len=max(map(len, prompts)) + args.steps + 2 * max(args.rows) + 16,
                         max_num_seqs=1, kv_gb=0.3)
        rows = step_costs(llm, prompts, args.rows, args.rounds, args.steps)
        del llm
    configs: dict[str, dict | None] = {"none": None}
    for k in [] if args.skip_ks else args.ks:
        configs[f"ngram k={k}"] = {"method": "ngram", "num_speculative_tokens": k}
        for name, spec in args.configs.items():
            configs[f"{name} k={k}"] = {**spec, "num_speculative_tokens": k}
    ks = [] if args.skip_ks else ngram_vs_k(prompts, configs, args)
    data = {"tag": args.tag, "env": C.env_info(), "args": vars(args), "load_start": load_start, "rows": rows,
            "ks": ks, "load_end": tuple(round(x, 2) for x in C.loadavg())}
    md = render(data)
    print("\n" + md, flush=True)
    C.save_results(f"verify_rows_{args.tag}", md, data)


if __name__ == "__main__":
    main()
