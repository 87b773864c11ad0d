"""Decode TPOT at TP=1 (one process, 2 threads) vs TP=2 (two worker processes, 1 thread each) on a random
Llama, with the all-reduce and all-gather (the vocab-parallel LM head's logits) time per step and the
all-reduce's share of the step. TP=2 runs once per collective backend (`--allreduce shm,gloo`: the
shared-memory segment for both collectives, or gloo for both; PAGELLM_TP_ALLREDUCE), the rows of each
round interleaved.

    python benchmarks/bench_tensor_parallel.py                # ~1B random Llama (bf16), batch 1, 64 tokens
    python benchmarks/bench_tensor_parallel.py --tiny --new-tokens 8    # smoke run (tiny model, seconds)
    python benchmarks/bench_tensor_parallel.py --new-tokens 32 --rounds 2 --allreduce shm,gloo

TP=2 ranks pin themselves to one half of the allowed CPUs each (pagellm.engine.mp_worker); TP=1 gets all of
them (PAGELLM_NUM_THREADS = the CPU count). TPOT is the mean time of the decode steps after the first
(prefill) step, measured in the driver (so TP=2 includes the pickled step message and the reply).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ONE_B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)


def write_random_llama(path: Path, shape: dict, dtype: torch.dtype) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    cfg = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(cfg).to(dtype).save_pretrained(str(path))
    return path


def _rank_collective_times(worker):
    """Run on every rank (collective_rpc): seconds and calls of each collective since the last call."""
    from pagellm.distributed.communication import take_collective_times

    return take_collective_times()


def measure(model: str, tp: int, dtype: str, prompt_len: int, new_tokens: int) -> dict:
    from pagellm.config import EngineArgs
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(model=model, dtype=dtype, tensor_parallel_size=tp,
                                                   num_kv_blocks=64, max_model_len=512, block_size=16))
    try:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        prompt = {"prompt_token_ids": [(7 * i) % 500 + 3 for i in range(prompt_len)]}
        engine.add_request("warmup", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        engine.collective_rpc(_rank_collective_times)  # reset the counters
        engine.add_request("timed", prompt, params)
        engine.step()  # prefill
        step_s = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t0)
        times = engine.collective_rpc(_rank_collective_times)[0] if tp > 1 else {}
    finally:
        engine.shutdown()
    tpot = statistics.mean(step_s)
    ar_s, ar_calls = times.get("all_reduce", (0.0, 0))
    ag_s, _ = times.get("all_gather", (0.0, 0))
    steps = len(step_s) + 1  # the counters include the prefill step
    return {"tp": tp, "tpot_ms": tpot * 1e3, "all_reduce_ms_per_step": ar_s / steps * 1e3,
            "all_reduces_per_step": ar_calls / steps, "all_gather_ms_per_step": ag_s / steps * 1e3,
            "all_reduce_share": (ar_s / steps) / tpot if tp > 1 else 0.0}


def print_row(r: dict) -> None:
    print(f"| {r['tp']} | {r['backend']} | {r['tpot_ms']:.2f} | {r['all_reduce_ms_per_step']:.2f} | "
          f"{r['all_reduces_per_step']:.0f} | {r['all_gather_ms_per_step']:.2f} | "
          f"{100 * r['all_reduce_share']:.0f}% |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny random model (smoke run)")
    p.add_argument("--model", default=None, help="an HF directory (default: a random Llama written to a temp dir)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--allreduce", default="shm,gloo", help="TP=2 collective backends to run, comma-separated")
    p.add_argument("--rounds", type=int, default=1, help="repeat TP=1 and each TP=2 backend, interleaved")
    a = p.parse_args()
    backends = [b.strip() for b in a.allreduce.split(",") if b.strip()]
    if not backends or any(b not in ("shm", "gloo") for b in backends) or a.rounds < 1:
        print(f"--allreduce must list shm and/or gloo (got {a.allreduce!r}); --rounds >= 1", file=sys.stderr)
        return 2
    dtype = a.dtype or ("float32" if a.tiny else "bfloat16")
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        print("needs at least 2 allowed CPUs", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or str(write_random_llama(Path(tmp) / "llama", TINY if a.tiny else ONE_B,
                                                  getattr(torch, dtype)))
        print(f"decode TPOT, batch 1, prompt {a.prompt_len}, {a.new_tokens} new tokens, {dtype}, {cpus} CPUs, "
              f"load at start {os.getloadavg()[0]:.1f}")
        print("| TP | collectives | TPOT ms | all-reduce ms/step | all-reduces/step | all-gather ms/step "
              "| all-reduce share |")
        print("|---|---|---:|---:|---:|---:|---:|", flush=True)
        for _ in range(a.rounds):  # each row printed when measured: a long run that dies keeps its rows
            os.environ["PAGELLM_NUM_THREADS"] = str(cpus)  # TP=1: every CPU
            print_row({"backend": "-", **measure(model, 1, dtype, a.prompt_len, a.new_tokens)})
            del os.environ["PAGELLM_NUM_THREADS"]  # TP=2: each rank its half (its affinity)
            for backend in backends:
                os.environ["PAGELLM_TP_ALLREDUCE"] = backend  # the spawned ranks inherit it
                print_row({"backend": backend, **measure(model, 2, dtype, a.prompt_len, a.new_tokens)})
                del os.environ["PAGELLM_TP_ALLREDUCE"]
    return 0


if __name__ == "__main__":
    sys.exit(main())
