"""Runs greedy generations with one of the CPU kernel libraries and prints them as JSON (one process each).

Used by tests/ops/test_isa_variants.py and `make isa-check` to compare the kernel libraries built for
different instruction sets (_C_cpu_avx2.so, _C_cpu_avx512.so) on the same machine:

    python tests/ops/isa_variant_runner.py --cpu-isa avx2 --model DIR --dtype bfloat16 --max-tokens 24 \
        [--tpot-tokens 64]

--cpu-isa: the library to load (sets PAGELLM_CPU_ISA before pagellm is imported; omitted: the best one).
--extension: a _C shared object to load instead of the installed one (e.g. an older build to compare with).
--model: an HF model directory, or "default" (the default model, from its GGUF).
Output: {"extension", "cpu_isa", "dtype", "results": [{"prompt", "token_ids", "text", "logprobs": [hex
floats]}], "tpot_ms"?}. Logprobs are written with float.hex so that the comparison is bit for bit.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import os
import sys
import time

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time there was a little engine that could.",
]


class _ExtensionFinder(importlib.abc.MetaPathFinder):
    """Resolves `pagellm._C` to one shared object (so `import pagellm._C` anywhere loads that build)."""

    def __init__(self, path: str):
        self.path = path

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "pagellm._C":
            return None
        return importlib.util.spec_from_file_location(fullname, self.path)


def use_extension(path: str | None) -> None:
    """Makes `pagellm._C` load from `path` (None: the installed build). Call before importing pagellm."""
    if "pagellm._C" in sys.modules:
        raise RuntimeError("pagellm._C is already imported; choose the extension first")
    if path is not None:
        sys.meta_path.insert(0, _ExtensionFinder(path))


def greedy_results(llm, max_tokens: int) -> list[dict]:
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    results = []
    for prompt, out in zip(PROMPTS, outputs):
        comp = out.outputs[0]
        chosen = [float(step[tok].logprob).hex() for tok, step in zip(comp.token_ids, comp.logprobs)]
        results.append({"prompt": prompt, "token_ids": list(comp.token_ids), "text": comp.text, "logprobs": chosen})
    return results


def batch1_tpot_ms(llm, num_tokens: int) -> float:
    """Decode time per output token of one request (prefill of a short prompt subtracted)."""
    from pagellm import SamplingParams

    def run(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    run(8)  # warm-up (step graphs, caches)
    short, long = min(run(1) for _ in range(3)), min(run(num_tokens + 1) for _ in range(2))
    return (long - short) / num_tokens * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-isa", default=None, help="CPU kernel library to load (PAGELLM_CPU_ISA): avx2, avx512")
    ap.add_argument("--extension", default=None, help="path of the pagellm._C shared object to load")
    ap.add_argument("--model", required=True, help='HF model directory or "default"')
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--tpot-tokens", type=int, default=0, help="also measure batch-1 TPOT over this many tokens")
    args = ap.parse_args(argv)

    if args.cpu_isa is not None:
        os.environ["PAGELLM_CPU_ISA"] = args.cpu_isa
    use_extension(args.extension)
    import pagellm._C
    from pagellm import LLM
    from pagellm.cpu_isa import loaded_cpu_isa

    model = None if args.model == "default" else args.model
    llm = LLM(model=model, dtype=args.dtype, max_model_len=256, max_num_seqs=4, kv_cache_memory_gb=0.05,
              block_size=16, seed=0)
    report = {"extension": pagellm._C.__file__, "cpu_isa": loaded_cpu_isa(), "dtype": args.dtype,
              "results": greedy_results(llm, args.max_tokens)}
    if args.tpot_tokens:
        report["tpot_ms"] = batch1_tpot_ms(llm, args.tpot_tokens)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
