"""The engine on device="cuda" against HF transformers on the same GPU and weights.

A tiny random Llama (head_dim 64: the CUDA attention kernels' smallest head size), prompts that cross the
16-token block boundary, greedy decoding: fp32 must give HF's tokens exactly; bf16 is compared with HF in bf16
(argmax near-ties may flip late tokens, so it reports the first divergence). Each configuration runs eager and
with step graphs, and a batch-invariance check runs one prompt alone and inside the batch.
Prints a table; writes engine.json under --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import build_tiny_tokenizer, write_tiny_llama  # noqa: E402

NEW = 24
LENS = [3, 15, 16, 17, 40, 70]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = []
    with torch.no_grad():
        res = model(torch.tensor([prompt], device="cuda"), use_cache=True)
        for _ in range(n):
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            res = model(torch.tensor([[nxt]], device="cuda"), past_key_values=res.past_key_values, use_cache=True)
    return out


def first_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gpu-out")
    args = ap.parse_args()
    from transformers import LlamaForCausalLM

    from pagellm import LLM, SamplingParams

    tok = build_tiny_tokenizer()
    tmp = Path(tempfile.mkdtemp())
    path = write_tiny_llama(tmp / "llama", tok, hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, len(tok)) for _ in range(n)] for n in LENS]
    refs = {}
    for dtype in ("float32", "bfloat16"):
        hf = LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).cuda().eval()
        refs[dtype] = [hf_greedy(hf, p, NEW) for p in prompts]
        del hf
    rows = []
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        for eager in (True, False):
            row = dict(dtype=dtype, enforce_eager=eager)
            try:
                t0 = time.perf_counter()
                llm = LLM(str(path), device="cuda", dtype=dtype, enforce_eager=eager, max_model_len=256, seed=0,
                          kv_cache_memory_gb=0.5)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
                toks = [o.outputs[0].token_ids for o in outs]
                div = [first_divergence(t, r) for t, r in zip(toks, refs[dtype])]
                alone = llm.generate([{"prompt_token_ids": prompts[4]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
                graphs = llm.llm_engine.executor.driver_worker.runner.cuda_graphs
                row.update(cuda_graphs_captured=None if graphs is None else graphs.num_captures)
                row.update(exact=sum(d == -1 for d in div), of=len(div), first_divergence=div,
                           batch_invariant=list(alone) == list(toks[4]), seconds=round(time.perf_counter() - t0, 1))
                del llm
            except Exception as e:  # report and go on: one failing configuration must not hide the others
                row.update(error=f"{type(e).__name__}: {e}"[:400], trace=traceback.format_exc()[-3000:])
                traceback.print_exc()
            rows.append(row)
            torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "engine.json").write_text(json.dumps(rows, indent=1))
    print("| dtype | eager | CUDA graphs captured | exact / prompts | first divergence | alone == batched | s | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['enforce_eager']} | {r.get('cuda_graphs_captured', '-')} | "
              f"{r.get('exact', '-')} / {r.get('of', '-')} | "
              f"{r.get('first_divergence', '-')} | {r.get('batch_invariant', '-')} | {r.get('seconds', '-')} | "
              f"{r.get('error', '')[:120]} |")
    ok = all(r.get("exact") == r.get("of") for r in rows if r["dtype"] == "float32")
    print("engine_check:", "fp32 exact on every configuration" if ok else "FAILURES (see above)")


if __name__ == "__main__":
    main()
