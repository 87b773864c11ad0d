#!/usr/bin/env python
"""Batch-1 decode of the default model (SmolLM2-135M-Instruct, a Q4_1 GGUF): today's dequantized weights in
bf16 vs the GGUF blocks used natively (quantization="gguf", bf16 activations), in one interleaved run.

    python benchmarks/bench_gguf.py                  # prompt 128, 64 new tokens, 3 rounds
    python benchmarks/bench_gguf.py --quick          # prompt 32, 16 new tokens, 3 rounds
    python benchmarks/bench_gguf.py --op             # the op alone: M = 1, 2048 x 2048, Q4_K / Q6_K vs Q4_1 vs bf16

Each round streams one request through each engine in turn (LLMEngine.add_request / step, greedy,
`ignore_eos`); TPOT is the median over rounds. Weight bytes per decode token, as stored (uint8 GGUF
blocks at their size, float tensors at the model dtype), every tensor once: the decoder's linear layers,
the LM head (it reads its whole weight: the file's Q8_0 blocks natively, bf16 dequantized; a tied embedding
is the same tensor, an untied one adds one row per token) and the rest (norms); plus K/V bytes at the mean
context. MBU = those bytes / TPOT / copy bandwidth (a large tensor.copy_, read + write, measured in the
same run).
Writes benchmarks/results/gguf_<tag>.{md,json}.

--op: gguf_linear alone at M = 1 (bf16 x [1, 2048]) on a 2048 x 2048 weight of random valid blocks: Q4_K, Q6_K
and Q4_1, each in the file's layout and row-packed (what a bf16 model holds on an AVX-512 VNNI CPU), against the
dense bf16 weight through linear_small_m (the bf16 model's decode linear). Variants interleaved call by call in
every round; per-call time is the median over rounds, and the best round beside it (on a shared machine most
rounds can be preempted: the best is then the cleaner estimate); "vs Q4_1 packed" compares time and time per
weight byte with row-packed Q4_1 measured in the same rounds (medians, and bests in brackets). Writes benchmarks/results/gguf_op_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import common as C
import torch
from bench_latency import stream_one

VARIANTS = {"dequantized bf16": None, "native GGUF (Q4_1 linears, Q8_0 head)": "gguf"}


def decode_weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Weight bytes one batch-1 decode step reads, each tensor once at its stored size: "linear" (the decoder's
    Linear layers), "head" (the LM head's whole weight, plus one row of an untied input embedding) and
    "other" (norms); "total" is their sum."""
    from pagellm.layers import LMHead, Linear, VocabEmbedding

    parts, seen = {"linear": 0, "head": 0, "other": 0}, set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.data_ptr() in seen:
                continue  # a tied head's blocks are the embedding's
            seen.add(p.data_ptr())
            nbytes = p.numel() * p.element_size()
            if isinstance(module, Linear):
                parts["linear"] += nbytes
            elif isinstance(module, VocabEmbedding):
                tied = isinstance(model.lm_head, LMHead) and model.lm_head.tied
                parts["head"] += nbytes if tied else nbytes // module.num_embeddings
            elif isinstance(module, LMHead):
                parts["head"] += nbytes
            else:
                parts["other"] += nbytes
    return {**parts, "total": sum(parts.values())}


def make_engine(quantization: str | None, args):
    llm = C.make_llm("smollm2-135m", max_model_len=args.prompt_len + args.output_len + 16, max_num_seqs=1,
                     kv_gb=0.25, quantization=quantization)
    eng = llm.llm_engine
    info = C.model_bytes_per_decode_token(eng.model, eng.model_files.hf_config)  # for its K/V bytes per token
    parts = decode_weight_bytes(eng.model)
    info.update(weight_bytes=parts["total"], linear_bytes=parts["linear"], head_bytes=parts["head"])
    return llm, info


def run(args) -> dict:
    tok, _ = C.load_tokenizer_for_prompts()
    pool = C.doc_token_pool(tok, max_chars=100_000)
    prompt = pool[1000:1000 + args.prompt_len]
    engines = {name: make_engine(q, args) for name, q in VARIANTS.items()}
    for name, (llm, _) in engines.items():  # warm-up: first steps capture the decode step graphs
        stream_one(llm.llm_engine, pool[:48], 12, f"warm-{name}")
    bw = C.copy_bandwidth_gbs(256 << 20, 6)
    print(f"[bandwidth] copy_ {bw['best_gbs']:.1f} GB/s (read+write, best), median {bw['median_gbs']:.1f}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, (llm, _) in engines.items():
            llm.llm_engine.reset_prefix_cache()
            res = stream_one(llm.llm_engine, prompt, args.output_len, f"r{r}-{name}")
            runs[name].append(res)
            print(f"[round {r}] {name}: TPOT {res['tpot_ms']:.2f} ms  TTFT {res['ttft_ms']:.1f} ms", flush=True)
    mean_ctx = args.prompt_len + (args.output_len - 1) / 2
    results = []
    for name, (llm, info) in engines.items():
        tpot = statistics.median(x["tpot_ms"] for x in runs[name])
        read = info["weight_bytes"] + info["kv_bytes_per_ctx_token"] * mean_ctx
        results.append({"variant": name, "linear_bytes": info["linear_bytes"], "head_bytes": info["head_bytes"],
                        "weight_bytes": info["weight_bytes"],
                        "bytes_per_decode_token": read, "tpot_ms": tpot,
                        "ttft_ms": statistics.median(x["ttft_ms"] for x in runs[name]),
                        "achieved_gbs": read / (tpot / 1e3) / 1e9, "mbu": read / (tpot / 1e3) / 1e9 / bw["best_gbs"],
                        "runs": runs[name]})
    del engines
    gc.collect()
    return {"copy_bandwidth": bw, "results": results}


def _random_blocks(n: int, k: int, type_name: str) -> torch.Tensor:
    """uint8 [n, row bytes]: random quant bytes with small positive fp16 scales where the type keeps them."""
    from pagellm.ops.reference import GGUF_QTYPES, gguf_row_bytes

    qtype = GGUF_QTYPES[type_name]
    rows = torch.randint(0, 256, (n, gguf_row_bytes(qtype, k)), dtype=torch.uint8)
    blocks = rows.view(n, -1, {"Q4_1": 20, "Q4_K": 144, "Q6_K": 210}[type_name])
    scale_offsets = {"Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}[type_name]
    for off in scale_offsets:
        blocks[..., off:off + 2] = torch.full(blocks.shape[:2] + (1,), 1e-3, dtype=torch.float16).view(torch.uint8)
    return rows


def run_op(args) -> dict:
    """Interleaved per-call timings of gguf_linear at M = 1 vs the bf16 dense linear (see --op in the docstring)."""
    from pagellm.ops.reference import GGUF_QTYPES
    from pagellm.quantization.gguf_packing import PACKED_FLAG, pack_rows

    n = k = args.op_size
    x = torch.randn(1, k).to(torch.bfloat16)
    out = torch.empty(1, n, dtype=torch.bfloat16)
    dense = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    calls = {"bf16 dense (linear_small_m)": (dense.numel() * 2,
                                             lambda: torch.ops.pagellm.linear_small_m(out, x, dense, None))}
    for name in ("Q4_K", "Q6_K", "Q4_1"):
        qw, qt = _random_blocks(n, k, name), GGUF_QTYPES[name]
        calls[f"{name} file layout"] = (qw.numel(), lambda qw=qw, qt=qt: torch.ops.pagellm.gguf_linear(
            out, x, qw, qt, k, None))
        packed = pack_rows(qw, qt)
        calls[f"{name} row-packed"] = (packed.numel(), lambda packed=packed, qt=qt: torch.ops.pagellm.gguf_linear(
            out, x, packed, qt | PACKED_FLAG, k, None))
    per_call: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, (_, fn) in calls.items():
            t = time.perf_counter()
            for _ in range(args.op_iters):
                fn()
            if r:
                per_call[name].append((time.perf_counter() - t) / args.op_iters * 1e6)
    base = statistics.median(per_call["bf16 dense (linear_small_m)"])
    q4_1 = per_call["Q4_1 row-packed"]
    q4_1_us, q4_1_best, q4_1_bytes = statistics.median(q4_1), min(q4_1), calls["Q4_1 row-packed"][0]
    results = []
    for name, (nbytes, _) in calls.items():
        us, best = statistics.median(per_call[name]), min(per_call[name])
        results.append({"variant": name, "weight_bytes": nbytes, "us_per_call": us, "best_us_per_call": best,
                        "gbs": nbytes / us / 1e3, "speedup_vs_bf16": base / us, "time_vs_q4_1_packed": us / q4_1_us,
                        "best_time_vs_q4_1_packed": best / q4_1_best,
                        "time_per_byte_vs_q4_1_packed": (us / nbytes) / (q4_1_us / q4_1_bytes),
                        "best_time_per_byte_vs_q4_1_packed": (best / nbytes) / (q4_1_best / q4_1_bytes),
                        "rounds_us": per_call[name]})
    return {"results": results}


def render_op(data: dict) -> str:
    e, a = data["env"], data["args"]
    out = [f"# gguf_linear at M = 1: k-quants vs Q4_1 (file layout and row-packed) vs bf16 ({data['tag']})", "",
           f"{e['time']}, {e['cpu']}, {e['nproc']} cores, torch {e['torch']} ({e['torch_threads']} threads), "
           f"git {e['git_head']}. Load average before: {tuple(round(v, 2) for v in data['load']['load_at_start'])}, "
           f"after: {tuple(round(v, 2) for v in data['load_at_end'])}.", "",
           f"x bf16 [1, {a['op_size']}], weight {a['op_size']} x {a['op_size']}; {a['rounds']} interleaved rounds of "
           f"{a['op_iters']} calls per variant, median per-call time.", ""]
    rows = [[r["variant"], f"{r['weight_bytes'] / 1e6:.2f} MB", r["us_per_call"], r["best_us_per_call"], r["gbs"],
             f"{r['speedup_vs_bf16']:.2f}x",
             f"{r['time_vs_q4_1_packed']:.2f}x ({r['best_time_vs_q4_1_packed']:.2f}x)",
             f"{r['time_per_byte_vs_q4_1_packed']:.2f}x ({r['best_time_per_byte_vs_q4_1_packed']:.2f}x)"]
            for r in data["results"]]
    out.append(C.md_table(["weight", "bytes", "us / call", "best us / call", "weight GB/s", "speedup vs bf16",
                           "time vs Q4_1 packed (best)", "time / byte vs Q4_1 packed (best)"], rows))
    return "\n".join(out)


def render(data: dict) -> str:
    e, bw, a = data["env"], data["copy_bandwidth"], data["args"]
    base = data["results"][0]["tpot_ms"]
    out = [f"# GGUF blocks natively vs dequantized bf16 ({data['tag']})", "",
           f"{e['time']}, {e['cpu']}, {e['nproc']} cores, torch {e['torch']} ({e['torch_threads']} threads), "
           f"git {e['git_head']}. Load average before: {tuple(round(x, 2) for x in data['load']['load_at_start'])}, "
           f"after: {tuple(round(x, 2) for x in data['load_at_end'])}.", "",
           f"Default model, batch 1, prompt {a['prompt_len']} tokens, {a['output_len']} new tokens, greedy, bf16 "
           f"activations; {a['rounds']} interleaved rounds, medians. Copy bandwidth (tensor.copy_, read+write): best "
           f"{bw['best_gbs']:.1f} GB/s, median {bw['median_gbs']:.1f} GB/s; MBU uses the best.", ""]
    rows = [[r["variant"], f"{r['linear_bytes'] / 1e6:.0f} MB", f"{r['head_bytes'] / 1e6:.0f} MB",
             f"{(r['weight_bytes'] - r['linear_bytes'] - r['head_bytes']) / 1e6:.2f} MB",
             f"{r['bytes_per_decode_token'] / 1e6:.0f} MB", r["tpot_ms"], r["ttft_ms"], r["achieved_gbs"],
             f"{r['mbu']:.2f}", f"{base / r['tpot_ms']:.2f}x"] for r in data["results"]]
    out.append(C.md_table(["weights", "decoder linears", "embedding/LM head", "norms", "bytes/decode tok",
                           "TPOT ms", "TTFT ms", "achieved GB/s", "MBU", "TPOT speedup"], rows))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="auto",
                    help="torch threads; auto: torch's default if the load wait succeeded, else 1")
    ap.add_argument("--wait-load", type=float, default=2.5)
    ap.add_argument("--wait-timeout", type=float, default=300)
    ap.add_argument("--quick", action="store_true", help="prompt 32, 16 new tokens")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--op", action="store_true", help="time the op alone (M = 1) instead of the model")
    ap.add_argument("--op-size", type=int, default=2048, help="--op: N = K (a multiple of 256)")
    ap.add_argument("--op-iters", type=int, default=50, help="--op: calls per variant per round")
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.output_len = 32, 16
    tag = args.tag or ("quick" if args.quick else "full")
    load = C.wait_for_load(args.wait_load, args.wait_timeout) if args.wait_load > 0 else {
        "waited_s": 0, "load_ok": None, "load_at_start": C.loadavg()}
    C.setup_threads(1 if args.threads == "auto" and not load["load_ok"] else
                    (None if args.threads == "auto" else int(args.threads)))
    data = {"tag": tag, "env": C.env_info(), "load": load, "args": vars(args), **(run_op if args.op else run)(args)}
    data["load_at_end"] = C.loadavg()
    md = (render_op if args.op else render)(data)
    print("\n" + md, flush=True)
    C.save_results(f"gguf_op_{tag}" if args.op else f"gguf_{tag}", md, data)


if __name__ == "__main__":
    main()
