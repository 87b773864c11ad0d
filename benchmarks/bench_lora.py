"""Batched multi-LoRA throughput: the same offline batch with no adapter, with one adapter for every request,
and with N different adapters round-robin (one step mixes them: lora_apply gathers tokens by adapter slot).

    python benchmarks/bench_lora.py                          # default model, 4 adapters of rank 16
    python benchmarks/bench_lora.py --model /path/to/llama --num-adapters 8 --rank 8 --num-prompts 64

Adapters are random, PEFT format, on every linear of the model (written to a temporary directory). Rounds are
interleaved (none, one, N, none, ...) and medians reported: output tok/s and the ratio to no adapter.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

import common as C


def write_random_adapter(path: Path, model: torch.nn.Module, rank: int, seed: int) -> Path:
    """A PEFT adapter on every HF linear of a pagellm model (shapes from the model itself)."""
    import json

    from safetensors.torch import save_file

    from pagellm.lora.peft_loader import hf_linear_targets

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for hf_name, t in hf_linear_targets(model).items():
        tensors[f"base_model.model.{hf_name}.lora_A.weight"] = torch.randn(rank, t.in_features, generator=g) * 0.02
        tensors[f"base_model.model.{hf_name}.lora_B.weight"] = torch.randn(t.out_features, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    leaves = sorted({n.rpartition(".")[2] for n in hf_linear_targets(model)})
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank, "target_modules": leaves}))
    return path


def run_batch(llm, prompts: list[list[int]], output_len: int, lora_requests) -> float:
    """Output tokens per second of the whole batch, queued at once."""
    from pagellm import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0, detokenize=False)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora_requests)
    elapsed = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    C.setup_threads(args.threads)
    from pagellm import LoRARequest

    llm = C.make_llm(args.model, max_model_len=args.input_len + args.output_len + 16, max_num_seqs=args.num_prompts,
                     kv_gb=args.kv_cache_gb, enable_lora=True, max_loras=args.num_adapters,
                     max_lora_rank=args.rank, enable_prefix_caching=False)
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    names = [f"adapter{i}" for i in range(args.num_adapters)]
    for i, name in enumerate(names):
        llm.load_lora(name, str(write_random_adapter(tmp / name, llm.llm_engine.model, args.rank, seed=i)))
    vocab = llm.llm_engine.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    modes = {
        "no adapter": None,
        "1 adapter": LoRARequest(names[0], 1),
        f"{args.num_adapters} adapters": [LoRARequest(names[i % len(names)], 1 + i % len(names))
                                          for i in range(args.num_prompts)],
    }
    run_batch(llm, prompts[:4], 4, None)  # warm-up
    tps: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode, lr in modes.items():
            tps[mode].append(run_batch(llm, prompts, args.output_len, lr))
    base = statistics.median(tps["no adapter"])
    rows = [[mode, statistics.median(v), statistics.median(v) / base] for mode, v in tps.items()]
    md = (f"LoRA throughput: {args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out), rank {args.rank}, "
          f"model {args.model}, median of {args.rounds} interleaved rounds\n\n"
          + C.md_table(["mode", "output tok/s", "vs no adapter"], rows))
    print(md)
    if not args.no_save:
        C.save_results("lora", md, {"args": vars(args), "tok_s": tps, "env": C.env_info()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
