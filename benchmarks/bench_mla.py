#!/usr/bin/env python
"""MLA (DeepSeek-V2 layout) vs MHA (Llama) of the same hidden size: KV-cache bytes per token and batch-1
decode TPOT at a long context, on random weights the benchmark writes itself.

The MLA model caches one latent row per token and layer (kv_lora_rank + qk_rope_head_dim values) and its
decode reads only that (absorbed weights); the MHA model caches K and V for every head. TPOT is measured
through LLM.generate: (time of prompt + 1 + n tokens - time of prompt + 1 token) / n, both with the prefix
cache off, so the prefill cancels.

    python benchmarks/bench_mla.py                      # hidden 1024, 4 layers, 4k context, bf16; saves results/
    python benchmarks/bench_mla.py --quick              # smoke run: tiny models, 256-token context, not saved
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def model_configs(hidden: int, layers: int, heads: int, vocab: int, max_len: int) -> dict[str, dict]:
    """HF config kwargs for the two models: same hidden size, layers, heads and MLP width."""
    head_dim = hidden // heads
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_len,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    # latent 256 = 224 + 32 (a width the CPU decode kernel takes: a multiple of 16, <= 512)
    mla = dict(common, q_lora_rank=None, kv_lora_rank=max(16, 7 * head_dim // 2), qk_nope_head_dim=head_dim,
               qk_rope_head_dim=max(16, head_dim // 2), v_head_dim=head_dim, n_routed_experts=8,
               num_experts_per_tok=2, first_k_dense_replace=layers, moe_intermediate_size=hidden // 4)
    return {"mla (DeepseekV2)": mla, "mha (Llama)": dict(common, head_dim=head_dim)}


def write_random_model(kind: str, kwargs: dict, root: Path, dtype: torch.dtype) -> Path:
    import transformers as tf

    cfg_cls, model_cls = ((tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM) if kind.startswith("mla")
                          else (tf.LlamaConfig, tf.LlamaForCausalLM))
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kwargs)).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    path = root / kind.split()[0]
    model.save_pretrained(path)
    return path


def kv_bytes_per_token(llm) -> int:
    worker = llm.llm_engine.executor.driver_worker
    specs = worker.model.kv_cache_specs(16, worker.kv_cache_dtype)
    return sum(s.page_size_bytes for s in specs.values()) // 16


def decode_tpot(llm, context: int, new_tokens: int, vocab: int, repeats: int) -> float:
    from pagellm import SamplingParams

    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(vocab) for _ in range(context)]}

    def run(n: int) -> float:
        t = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    run(2)  # warm-up (step graphs, allocator)
    diffs = sorted(run(1 + new_tokens) - run(1) for _ in range(repeats))
    return diffs[len(diffs) // 2] / new_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models, short context, not saved")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = ap.parse_args()
    if a.quick:
        a.hidden, a.layers, a.heads, a.context, a.new_tokens, a.repeats = 128, 2, 4, 256, 8, 1
    from pagellm import LLM

    vocab, dtype = 512, getattr(torch, a.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, kwargs in model_configs(a.hidden, a.layers, a.heads, vocab, a.context + 64).items():
            path = write_random_model(kind, kwargs, Path(tmp), dtype)
            llm = LLM(str(path), dtype=a.dtype, max_model_len=a.context + 64, max_num_seqs=1,
                      enable_prefix_caching=False, seed=0)
            rows.append((kind, kv_bytes_per_token(llm), decode_tpot(llm, a.context, a.new_tokens, vocab, a.repeats)))
            del llm
    lines = [f"hidden {a.hidden}, {a.layers} layers, {a.heads} heads, {a.dtype}, context {a.context}, batch 1", "",
             "| model | KV bytes / token | KV MiB at context | decode TPOT (ms) |", "|---|---:|---:|---:|"]
    for kind, per_token, tpot in rows:
        lines.append(f"| {kind} | {per_token} | {per_token * a.context / 2**20:.1f} | {tpot * 1e3:.2f} |")
    table = "\n".join(lines)
    print(table)
    if not a.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "bench_mla.md").write_text(table + "\n")
        (RESULTS / "bench_mla.json").write_text(json.dumps(
            [{"model": k, "kv_bytes_per_token": b, "tpot_s": t} for k, b, t in rows], indent=1))


if __name__ == "__main__":
    main()
