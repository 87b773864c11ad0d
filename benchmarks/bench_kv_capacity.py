#!/usr/bin/env python
"""KV capacity: how many 2048-token sequences fit one fixed KV budget, for attention variants of one small model.

    python benchmarks/bench_kv_capacity.py                 # computed + measured, 64 MiB, bf16
    python benchmarks/bench_kv_capacity.py --no-measure    # computed only (seconds)
    python benchmarks/bench_kv_capacity.py --docs-table    # the KV-bytes-per-token table of docs/kv_cache_layout.md

Model shape: hidden 512, 8 layers, 8 query heads of 64 (random bf16 weights, vocab 512). Variants:

    MHA          8 kv heads
    GQA          2 kv heads
    MLA          DeepSeek-V2 attention, dense MLP, kv_lora_rank 64 + rope 16 (one 80-wide latent row per token)
    MHA/GQA + shared-KV   layers 4-7 read the cache of layers 0-3 (kv_sharing_layers), allocating nothing
    GQA chunked / GQA + sliding window 256 chunked    the same GQA model as full attention (Llama) and with a 256-token
                 window on every layer (Mistral), prompts prefilled in 256-token chunks: the block manager frees
                 the blocks that left the window, so a request holds at most ceil((256 - 1 + 256) / 16) + 1 = 33
    Gemma-2-like mixed chunked (window as mask / sliding group freed)    Gemma 2 layers (every other one a 256-token
                 window, the rest global), 2 kv heads, 256-token chunks: the window as a mask only (one block table,
                 every block kept: the pre-hybrid path, forced here) vs the hybrid cache (a block table per group,
                 the sliding group holding at most 33 blocks per request, the global one all 128)

Computed: the engine's own KV-cache config for the budget (kv_cache_memory_gb): blocks, bytes per token
(KVCacheConfig.bytes_per_token), sequences = blocks // blocks per 2048-token sequence, and how many of them the
block manager admits at once (it keeps a 1 % watermark of blocks free; a chunked row: blocks // the most one
request holds at once, which admission does not reserve ahead, so preemptions are counted). Measured: the engine
run with more 2048-token requests (2040 random prompt tokens + 8 decoded, prefix caching off) than fit, the
peak number running together read between steps. Writes benchmarks/results/kv_capacity.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SEQ_LEN, DECODE_TOKENS, BLOCK_SIZE = 2048, 8, 16
SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, head_dim=64, intermediate_size=512,
             vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=True)
SHARE_HALF = {str(i): i - 4 for i in range(4, 8)}
# dense: a layer's MLP is MoE only from first_k_dense_replace on (the expert fields are then unused)
MLA_FIELDS = dict(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=48, v_head_dim=64, q_lora_rank=None,
                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=8,
                  num_key_value_heads=8)
GEMMA2_FIELDS = dict(num_key_value_heads=2, sliding_window=256, query_pre_attn_scalar=64,
                     hidden_activation="gelu_pytorch_tanh")
VARIANTS = {  # name -> (architecture, extra config fields)
    "MHA": ("llama", {"num_key_value_heads": 8}),
    "GQA": ("llama", {"num_key_value_heads": 2}),
    "MLA": ("deepseek_v2", MLA_FIELDS),
    "MHA + shared-KV (4 of 8)": ("llama", {"num_key_value_heads": 8, "kv_sharing_layers": SHARE_HALF}),
    "GQA + shared-KV (4 of 8)": ("llama", {"num_key_value_heads": 2, "kv_sharing_layers": SHARE_HALF}),
    "GQA chunked": ("llama", {"num_key_value_heads": 2}),
    "GQA + sliding window 256 chunked": ("mistral", {"num_key_value_heads": 2, "sliding_window": 256}),
    "Gemma-2-like mixed chunked (window as mask)": ("gemma2", GEMMA2_FIELDS),
    "Gemma-2-like mixed chunked (sliding group freed)": ("gemma2", GEMMA2_FIELDS),
}
CHUNK = 256  # prefill chunk of the "chunked" rows (long_prefill_token_threshold)


def write_model(arch: str, extra: dict, path: Path) -> Path:
    """Random bf16 weights saved with save_pretrained; a sharing layer's k_proj / v_proj dropped."""
    from safetensors.torch import load_file, save_file

    if arch == "llama":
        from transformers import LlamaConfig as Config, LlamaForCausalLM as Model
    elif arch == "mistral":
        from transformers import MistralConfig as Config, MistralForCausalLM as Model
    elif arch == "gemma2":
        from transformers import Gemma2Config as Config, Gemma2ForCausalLM as Model
    else:
        from transformers import DeepseekV2Config as Config, DeepseekV2ForCausalLM as Model
    torch.manual_seed(0)
    shape = {k: v for k, v in SHAPE.items() if arch != "deepseek_v2" or k != "head_dim"}  # MLA: its own head dims
    cfg = Config(**{**shape, **extra})
    Model(cfg).to(torch.bfloat16).save_pretrained(str(path))
    shared = extra.get("kv_sharing_layers", {})
    if shared:
        f = path / "model.safetensors"
        drop = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in shared for p in "kv"}
        save_file({k: v for k, v in load_file(f).items() if k not in drop}, f)
    return path


def make_llm(path: Path, budget_mib: int, max_num_seqs: int, window_as_mask: bool = False, chunk: int = 0):
    """`window_as_mask`: a mixed model on the pre-hybrid path (one block table, every block kept).
    `chunk` > 0: every prompt is prefilled `chunk` tokens per step (long_prefill_token_threshold), and the KV
    sizing counts those chunks (a hybrid cache's window group gets the blocks they need)."""
    from pagellm import LLM
    from pagellm.kv_cache import groups

    if window_as_mask:
        mixed = groups.is_mixed_window_model
        groups.is_mixed_window_model = lambda specs: False
        try:
            return make_llm(path, budget_mib, max_num_seqs, chunk=chunk)
        finally:
            groups.is_mixed_window_model = mixed

    # a token budget for every prompt at once: admission is limited by KV blocks alone, not by one prefill
    # per step against sequences that finish after DECODE_TOKENS steps
    return LLM(str(path), dtype="bfloat16", max_model_len=SEQ_LEN, max_num_seqs=max_num_seqs, block_size=BLOCK_SIZE,
               kv_cache_memory_gb=budget_mib / 1024, enable_prefix_caching=False, seed=0,
               max_num_batched_tokens=SEQ_LEN * max_num_seqs, long_prefill_token_threshold=chunk)


def measure_peak_running(llm, num_requests: int) -> dict:
    from pagellm import SamplingParams

    engine, rng = llm.llm_engine, random.Random(0)
    params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True, temperature=0, detokenize=False)
    for i in range(num_requests):
        ids = [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(SEQ_LEN - DECODE_TOKENS)]
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    t, peak, done = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        done += sum(o.finished for o in engine.step())
        peak = max(peak, engine.get_stats().num_running)
    assert done == num_requests
    return {"peak_running": peak, "run_s": round(time.perf_counter() - t, 1)}


def count_preemptions(llm) -> dict:
    """Wraps the scheduler's schedule() to count preempted requests (for the chunked rows)."""
    engine, counter = llm.llm_engine, {"preemptions": 0}

    class Counting:
        def __init__(self, inner):
            self._inner = inner

        def schedule(self):
            out = self._inner.schedule()
            counter["preemptions"] += len(out.preempted_request_ids)
            return out

        def __getattr__(self, name):
            return getattr(self._inner, name)

    engine.scheduler = Counting(engine.scheduler)
    return counter


def admitted_under_watermark(num_blocks: int, blocks_per_seq: int) -> int:
    """Sequences the block manager admits at once: it keeps `watermark` (CacheConfig, 1 %) of the blocks free."""
    from pagellm.config import CacheConfig

    reserve = int(CacheConfig().watermark * num_blocks)
    return (num_blocks - reserve) // blocks_per_seq


def run_variant(name: str, args, workdir: Path) -> dict:
    arch, extra = VARIANTS[name]
    path = write_model(arch, extra, workdir / "".join(c if c.isalnum() else "_" for c in name))
    from pagellm.kv_cache.sizing import max_blocks_per_request

    chunked = "chunked" in name
    llm = make_llm(path, args.budget_mib, max_num_seqs=64, window_as_mask=name.endswith("(window as mask)"),
                   chunk=CHUNK if chunked else 0)
    cfg = llm.llm_engine.kv_cache_config
    chunk = CHUNK if chunked else SEQ_LEN
    # per group (one unless the cache is hybrid): its blocks, the most one sequence holds there, its null block
    windows = [g.sliding_window for g in cfg.groups] if cfg.is_hybrid else [cfg.sliding_window]
    blocks = [cfg.num_blocks_of(g) for g in range(len(windows))]
    per_seq = [max_blocks_per_request(BLOCK_SIZE, SEQ_LEN, w, chunk) for w in windows]
    usable = [n - (1 if w else 0) for n, w in zip(blocks, windows)]  # a window reserves the null block
    row = {"variant": name, "blocks": " + ".join(map(str, blocks)), "bytes_per_token": cfg.bytes_per_token,
           "layers": cfg.describe_bytes_per_token().partition("(layers: ")[2].rstrip(")"),
           "blocks_per_seq": " + ".join(map(str, per_seq)),
           "computed_seqs": min(u // p for u, p in zip(usable, per_seq)),
           "computed_admitted": min(admitted_under_watermark(u, p) for u, p in zip(usable, per_seq))}
    if args.measure:
        counter = count_preemptions(llm)
        row.update(measure_peak_running(llm, row["computed_seqs"] + args.extra_requests), **counter)
    print(row, flush=True)
    return row


def markdown(rows: list[dict], args) -> str:
    lines = [f"KV budget {args.budget_mib} MiB (bf16 cache, block size {BLOCK_SIZE}), sequences of {SEQ_LEN} "
             f"tokens; model hidden 512, 8 layers, 8 query heads x 64.", "",
             "A hybrid cache lists blocks per group (sliding + global).", "",
             "| variant | KV layers | KV bytes / token | blocks | most blocks one seq holds | seqs that fit (computed) "
             "| admitted with the 1 % watermark (computed) | peak running (measured) | preemptions (measured) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['layers']} | {r['bytes_per_token']} | {r['blocks']} "
                     f"| {r['blocks_per_seq']} "
                     f"| {r['computed_seqs']} | {r['computed_admitted']} | {r.get('peak_running', 'not run')} "
                     f"| {r.get('preemptions', 'not run')} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the docs table (specs only, no model)
def docs_rows() -> list[tuple[str, str, dict]]:
    """(model, shape, layer id -> spec for a given dtype) of well-known shapes."""
    from pagellm.kv_cache import FullAttentionSpec as Full, MLAAttentionSpec as MLA, SharedKVSpec as Shared
    from pagellm.kv_cache import SlidingWindowSpec as Sliding

    def full(n, kv, hd):
        return lambda dt: {i: Full(16, kv, hd, dt) for i in range(n)}

    return [
        ("Llama-2-7B (MHA)", "32 layers x 32 kv heads x 128", full(32, 32, 128)),
        ("Llama-3-8B (GQA)", "32 layers x 8 kv heads x 128", full(32, 8, 128)),
        ("SmolLM2-135M (default model, GQA)", "30 layers x 3 kv heads x 64", full(30, 3, 64)),
        ("DeepSeek-V2-Lite-like (MLA)", "27 layers x latent 512 + rope 64",
         lambda dt: {i: MLA(16, 576, dt) for i in range(27)}),
        ("Gemma-2-2B-like (sliding / global)", "26 layers x 4 kv heads x 256, every other layer window 4096",
         lambda dt: {i: (Sliding(16, 4, 256, dt, 4096) if i % 2 == 0 else Full(16, 4, 256, dt)) for i in range(26)}),
        ("SmolLM2-135M + shared-KV (num_kv_shared_layers=15)", "15 of 30 layers read layer 14's cache",
         lambda dt: {i: (Full(16, 3, 64, dt) if i < 15 else Shared(14)) for i in range(30)}),
    ]


def docs_table() -> str:
    from pagellm.kv_cache import kv_bytes_per_token

    lines = ["| model | KV layout | bf16 bytes / token | int8 bytes / token |", "|---|---|---:|---:|"]
    for name, shape, specs in docs_rows():
        bf16, int8 = kv_bytes_per_token(specs(torch.bfloat16)), kv_bytes_per_token(specs("int8"))
        lines.append(f"| {name} | {shape} | {bf16:,} | {int8:,} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-mib", type=int, default=64)
    ap.add_argument("--no-measure", dest="measure", action="store_false", help="computed figures only")
    ap.add_argument("--extra-requests", type=int, default=2, help="requests beyond the computed capacity")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--docs-table", action="store_true", help="print the docs/kv_cache_layout.md table and exit")
    args = ap.parse_args()
    if args.docs_table:
        print(docs_table())
        return
    names = [n.strip() for n in args.variants.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="kv-capacity-") as tmp:
        rows = [run_variant(n, args, Path(tmp)) for n in names]
    md = markdown(rows, args)
    print(md)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv_capacity.md").write_text(md)
    (RESULTS / "kv_capacity.json").write_text(json.dumps({"budget_mib": args.budget_mib, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
