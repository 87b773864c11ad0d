"""Runs greedy generations with a chosen build of pagellm._C and prints them as JSON (one process per build).

Used by tests/ops/test_isa_variants.py and `make portable-check` to compare builds of the CPU kernels for
different instruction sets (e.g. -march=native vs -march=x86-64-v3) on the same machine:

    python tests/ops/isa_variant_runner.py --extension build/portable/_C.cpython-311-x86_64-linux-gnu.so \
        --model DIR --dtype bfloat16 --max-tokens 24 [--tpot-tokens 64]

--extension: the _C shared object to load instead of the installed one (omitted: the installed one).
--model: an HF model directory, or "default" (the default model, from its GGUF).
Output: {"extension", "dtype", "results": [{"prompt", "token_ids", "text", "logprobs": [hex floats]}],
"tpot_ms"?}. Logprobs are written with float.hex so that the comparison is bit for bit.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
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
    ap.add_argument("--extension", default=None, help="path of the pagellm._C shared object to load")
    ap.add_argument("--model", required=True, help='HF model directory or "default"')
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--tpot-tokens", type=int, default=0, help="also measure batch-1 TPOT over this many tokens")
    args = ap.parse_args(argv)

    use_extension(args.extension)
    import pagellm._C
    from pagellm import LLM

    model = None if args.model == "default" else args.model
    llm = LLM(model=model, dtype=args.dtype, max_model_len=256, max_num_seqs=4, kv_cache_memory_gb=0.05,
              block_size=16, seed=0)
    report = {"extension": pagellm._C.__file__, "dtype": args.dtype,
              "results": greedy_results(llm, args.max_tokens)}
    if args.tpot_tokens:
        report["tpot_ms"] = batch1_tpot_ms(llm, args.tpot_tokens)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
