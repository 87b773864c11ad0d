#!/usr/bin/env python
"""Batch-1 decode TPOT of a Q4_K_M-typed GGUF: dequantized bf16 vs the k-quant blocks natively, row-packed (what
a bf16 model holds on an AVX-512 VNNI CPU) and in the file's layout, in one interleaved run.

    python benchmarks/bench_gguf_k_quant.py                 # TinyLlama-1.1B's layer shapes, 22 layers
    python benchmarks/bench_gguf_k_quant.py --layers 4      # the same shapes, fewer layers (quicker)

gguf-py does not quantize k-quants and the default model's hidden size (576) is not a multiple of 256, so the
model is a random-weight Llama with TinyLlama-1.1B's decoder shape (hidden 2048, 32 / 4 heads, MLP 5632) and the
tests' tiny tokenizer (320 tokens: the LM head is small), written once by the tests' GGUF writer
(tests/models/test_gguf.write_llama_gguf, blocks from tests/ops/gguf_k_blocks.quantize_k) into
benchmarks/models/. Types as llama.cpp's Q4_K_M gives them: Q4_K linears and embedding, Q6_K attn_v and
ffn_down in the first and last eighth of the layers and every third one between, a Q6_K LM head.
Each round streams one request through each engine in turn (greedy, `ignore_eos`); TPOT is the median over
rounds. Writes benchmarks/results/gguf_k_quant_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import common as C
import numpy as np
import torch
from bench_gguf import decode_weight_bytes
from bench_latency import stream_one

TESTS = Path(__file__).resolve().parents[1] / "tests"
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4)


class _RandomLlama:
    """What write_llama_gguf reads from an HF model (config, state_dict) with random tensors made one at a
    time, so the float model never exists whole."""

    def __init__(self, config, seed: int = 0) -> None:
        self.config = config
        self.seed = seed

    def state_dict(self) -> "_RandomLlama":
        return self

    def items(self):
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            shapes = {n: t.shape for n, t in LlamaForCausalLM(self.config).state_dict().items()}
        g = torch.Generator().manual_seed(self.seed)
        for name, shape in shapes.items():
            yield name, (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02)


def _uses_more_bits(layer: int, n: int) -> bool:  # llama.cpp's Q4_K_M rule for attn_v / ffn_down
    return layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2


def write_model(path: Path, layers: int) -> Path:
    sys.path[:0] = [str(TESTS), str(TESTS / "models"), str(TESTS / "ops")]
    import gguf
    from gguf_k_blocks import quantize_k
    from test_gguf import write_llama_gguf
    from tiny_models import build_tiny_tokenizer
    from transformers import LlamaConfig

    Q = gguf.GGMLQuantizationType
    tok = build_tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), num_hidden_layers=layers, max_position_embeddings=2048,
                      tie_word_embeddings=False, **SHAPE)

    def qtype_of(_name: str, g: str, a: np.ndarray):
        if a.ndim != 2:
            return Q.F32
        if g == "output.weight":
            return Q.Q6_K
        kind = g.split(".")[2] if g.startswith("blk.") else ""
        if kind in ("attn_v", "ffn_down") and _uses_more_bits(int(g.split(".")[1]), layers):
            return Q.Q6_K
        return Q.Q4_K

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    write_llama_gguf(tmp, _RandomLlama(cfg), tok, qtype_of, lambda a, t: quantize_k(a, int(t)))
    tmp.rename(path)
    return path


def make_engine(path: Path, quantization: str | None, pack: bool, args):
    from pagellm import LLM
    from pagellm.quantization import gguf as gguf_method, gguf_mixed

    saved = gguf_method.packing_pays_off, gguf_mixed.packing_pays_off
    if not pack:  # the file's layout: the same kernels' fallback for unpacked blocks
        gguf_method.packing_pays_off = gguf_mixed.packing_pays_off = lambda *a: False
    try:
        llm = LLM(model=str(path), dtype="bfloat16", max_model_len=args.prompt_len + args.output_len + 16,
                  max_num_seqs=1, kv_cache_memory_gb=0.25, block_size=16, seed=0, quantization=quantization)
    finally:
        gguf_method.packing_pays_off, gguf_mixed.packing_pays_off = saved
    return llm, decode_weight_bytes(llm.llm_engine.model)


def run(args) -> dict:
    path = Path(__file__).parent / "models" / f"random-llama-1b-shape-{args.layers}l.Q4_K_M.gguf"
    if not path.exists():
        print(f"[write] {path}", flush=True)
        write_model(path, args.layers)
    variants = {"dequantized bf16": (None, False), "native Q4_K_M, file layout": ("gguf", False),
                "native Q4_K_M, row-packed": ("gguf", True)}
    engines = {name: make_engine(path, q, pack, args) for name, (q, pack) in variants.items()}
    prompt = list(np.random.default_rng(0).integers(10, 300, args.prompt_len))
    for name, (llm, _) in engines.items():  # warm-up: first steps capture the decode step graphs
        stream_one(llm.llm_engine, prompt[:16], 8, f"warm-{name}")
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, (llm, _) in engines.items():
            llm.llm_engine.reset_prefix_cache()
            res = stream_one(llm.llm_engine, prompt, args.output_len, f"r{r}-{name}")
            runs[name].append(res)
            print(f"[round {r}] {name}: TPOT {res['tpot_ms']:.2f} ms", flush=True)
    base = statistics.median(x["tpot_ms"] for x in runs["dequantized bf16"])
    results = []
    for name, (_, parts) in engines.items():
        tpot = statistics.median(x["tpot_ms"] for x in runs[name])
        results.append({"variant": name, "linear_bytes": parts["linear"], "weight_bytes": parts["total"],
                        "tpot_ms": tpot, "speedup_vs_bf16": base / tpot, "runs": runs[name]})
    return {"model": str(path.name), "results": results}


def render(data: dict) -> str:
    e, a = data["env"], data["args"]
    out = [f"# Q4_K_M GGUF natively vs dequantized bf16 ({data['tag']})", "",
           f"{e['time']}, {e['cpu']}, {e['nproc']} cores, torch {e['torch']} ({e['torch_threads']} threads), "
           f"git {e['git_head']}. Load average before: {tuple(round(x, 2) for x in data['load']['load_at_start'])}, "
           f"after: {tuple(round(x, 2) for x in data['load_at_end'])}.", "",
           f"{data['model']} (random weights, TinyLlama-1.1B's decoder shape, {a['layers']} layers, 320-token "
           f"vocabulary), batch 1, prompt {a['prompt_len']}, {a['output_len']} new tokens, greedy, bf16 "
           f"activations; {a['rounds']} interleaved rounds, medians.", ""]
    rows = [[r["variant"], f"{r['linear_bytes'] / 1e6:.0f} MB", f"{r['weight_bytes'] / 1e6:.0f} MB", r["tpot_ms"],
             f"{r['speedup_vs_bf16']:.2f}x"] for r in data["results"]]
    out.append(C.md_table(["weights", "decoder linears", "all weights", "TPOT ms", "speed-up vs bf16"], rows))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--tag", default="quick")
    args = ap.parse_args()
    C.setup_threads(args.threads)
    data = {"tag": args.tag, "env": C.env_info(), "load": {"load_at_start": C.loadavg()}, "args": vars(args),
            **run(args)}
    data["load_at_end"] = C.loadavg()
    md = render(data)
    print("\n" + md, flush=True)
    C.save_results(f"gguf_k_quant_{args.tag}", md, data)


if __name__ == "__main__":
    main()
