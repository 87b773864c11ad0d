#!/usr/bin/env python
"""Batch-1 decode of the default model (SmolLM2-135M-Instruct, a Q4_1 GGUF): today's dequantized weights in
bf16 vs the GGUF blocks used natively (quantization="gguf", bf16 activations), in one interleaved run.

    python benchmarks/bench_gguf.py                  # prompt 128, 64 new tokens, 3 rounds
    python benchmarks/bench_gguf.py --quick          # prompt 32, 16 new tokens, 3 rounds

Each round streams one request through each engine in turn (LLMEngine.add_request / step, greedy,
`ignore_eos`); TPOT is the median over rounds. Weight bytes per decode token, as stored (uint8 GGUF
blocks at their size, float tensors at the model dtype), every tensor once: the decoder's linear layers,
the LM head (it reads its whole weight: the file's Q8_0 blocks natively, bf16 dequantized; a tied embedding
is the same tensor, an untied one adds one row per token) and the rest (norms); plus K/V bytes at the mean
context. MBU = those bytes / TPOT / copy bandwidth (a large tensor.copy_, read + write, measured in the
same run).
Writes benchmarks/results/gguf_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import statistics

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
    args = ap.parse_args()
    if args.quick:
        args.prompt_len, args.output_len = 32, 16
    tag = args.tag or ("quick" if args.quick else "full")
    load = C.wait_for_load(args.wait_load, args.wait_timeout) if args.wait_load > 0 else {
        "waited_s": 0, "load_ok": None, "load_at_start": C.loadavg()}
    C.setup_threads(1 if args.threads == "auto" and not load["load_ok"] else
                    (None if args.threads == "auto" else int(args.threads)))
    data = {"tag": tag, "env": C.env_info(), "load": load, "args": vars(args), **run(args)}
    data["load_at_end"] = C.loadavg()
    md = render(data)
    print("\n" + md, flush=True)
    C.save_results(f"gguf_{tag}", md, data)


if __name__ == "__main__":
    main()
