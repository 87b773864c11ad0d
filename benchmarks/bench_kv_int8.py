#!/usr/bin/env python
"""int8 KV cache vs bf16 at the same KV budget, on the default model (SmolLM2-135M-Instruct, bf16 weights).

    python benchmarks/bench_kv_int8.py            # 128 requests, 16 perplexity windows of 1024 tokens
    python benchmarks/bench_kv_int8.py --quick    # smoke run (minutes on 2 cores)

Capacity and throughput: the same requests (prompts cut from Debian's python3.11-doc reST sources,
U[--input-len] prompt tokens, U[--output-len] forced output tokens, greedy) through an engine whose KV
cache gets --kv-cache-gb; max_num_seqs is high, so the cache, not the scheduler, caps how many sequences
run at once. Reported per cache dtype: blocks, sequences of max length that fit, the peak number of
sequences the engine actually ran together, output and total tok/s.

Perplexity: word-level perplexity of the model on the King James Bible (Debian's bible-kjv: `bible -f`,
verse references stripped), windows of --ppl-window tokens scored with prompt_logprobs (the KV of each
window is written to and read back from the cache under test). ppl = exp(NLL of the scored tokens / words
of the windows' text); the first token of each window is unscored in both runs. Target: int8 <= +0.5 %.
Writes benchmarks/results/kv_int8.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import math
import re
import subprocess
import time

import common as C

KJV_BOOKS = ("Gen1:1-50:26", "Ps1:1-150:6", "Mat1:1-28:20", "John1:1-21:25")


def kjv_text() -> str:
    """The KJV books above, one verse per line, references ("Ge1:1 ") stripped."""
    try:
        out = subprocess.run(["bible", "-f", *KJV_BOOKS], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError as e:
        raise SystemExit("the `bible` command is missing: apt-get install bible-kjv") from e
    return "\n".join(re.sub(r"^\S+\d+:\d+\s+", "", line).strip() for line in out.splitlines() if line.strip())


def make_llm(kv_cache_dtype: str, args):
    max_len = max(args.input_len[1] + args.output_len[1], args.ppl_window) + 16
    return C.make_llm("default", max_model_len=max_len,
                      max_num_seqs=args.max_num_seqs, kv_gb=args.kv_cache_gb, kv_cache_dtype=kv_cache_dtype,
                      max_num_batched_tokens=max(2048, args.ppl_window))


def run_throughput(llm, reqs: list[C.Request]) -> dict:
    """All requests queued at once, stepped to completion; peak concurrency read between steps."""
    from pagellm import SamplingParams

    engine = llm.llm_engine
    t = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.add_request(f"r{i}", {"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0, detokenize=False))
    peak, out_toks = 0, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out_toks += len(o.outputs[0].token_ids)
        peak = max(peak, engine.get_stats().num_running)
    el = time.perf_counter() - t
    in_toks = sum(len(r.prompt_token_ids) for r in reqs)
    assert out_toks == sum(r.output_len for r in reqs), "every request must produce its forced length"
    return {"elapsed_s": el, "peak_running": peak, "output_tok_s": out_toks / el,
            "total_tok_s": (in_toks + out_toks) / el}


def word_perplexity(llm, windows: list[list[int]], num_words: int) -> dict:
    from pagellm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll, scored = 0.0, 0
    for w, o in zip(windows, outs):
        for tok, lp in zip(w[1:], o.prompt_logprobs[1:]):
            nll -= lp[tok].logprob
            scored += 1
    return {"ppl_word": math.exp(nll / num_words), "ppl_token": math.exp(nll / scored), "scored_tokens": scored}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small settings (a smoke run)")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--input-len", type=int, nargs=2, default=[128, 512])
    p.add_argument("--output-len", type=int, nargs=2, default=[64, 256])
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="the KV budget both caches get")
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--ppl-windows", type=int, default=16)
    p.add_argument("--ppl-window", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.num_requests, args.input_len, args.output_len = 24, [64, 160], [16, 48]
        args.kv_cache_gb, args.ppl_windows, args.ppl_window = 0.02, 4, 512
    threads = C.setup_threads(args.threads)
    tok, _ = C.load_tokenizer_for_prompts()
    reqs = C.make_requests(C.doc_token_pool(tok), args.num_requests, tuple(args.input_len), tuple(args.output_len),
                           seed=args.seed)
    kjv = tok.encode(kjv_text(), add_special_tokens=False)
    windows = [kjv[i * args.ppl_window:(i + 1) * args.ppl_window] for i in range(args.ppl_windows)]
    num_words = len(tok.decode(sum(windows, [])).split())
    rows, data = [], {"args": vars(args), "threads": threads, "env": C.env_info(), "results": {}}
    for kv_dtype in ("auto", "int8"):
        llm = make_llm(kv_dtype, args)
        eng = llm.llm_engine
        max_len = args.input_len[1] + args.output_len[1]
        fit = (eng.num_blocks - 1) // math.ceil(max_len / 16)
        run_throughput(llm, reqs[:4])  # warm-up: first-call costs, step-graph captures
        load_before = C.loadavg()
        r = {"num_blocks": eng.num_blocks, "max_len_seqs_that_fit": fit, **run_throughput(llm, reqs),
             "loadavg_before": load_before, "loadavg_after": C.loadavg(), **word_perplexity(llm, windows, num_words)}
        data["results"][kv_dtype] = r
        name = "bf16" if kv_dtype == "auto" else kv_dtype
        print(f"[{name}] {r}", flush=True)
        rows.append([name, r["num_blocks"], r["max_len_seqs_that_fit"], r["peak_running"], r["output_tok_s"],
                     r["total_tok_s"], r["ppl_word"], r["ppl_token"]])
        del llm, eng
        gc.collect()
    base, q = data["results"]["auto"], data["results"]["int8"]
    data["ratios"] = {"blocks": q["num_blocks"] / base["num_blocks"], "peak_running": q["peak_running"] / base[
        "peak_running"], "output_tok_s": q["output_tok_s"] / base["output_tok_s"],
        "ppl_word_change_pct": 100 * (q["ppl_word"] / base["ppl_word"] - 1)}
    md = (f"KV cache int8 vs bf16, SmolLM2-135M-Instruct (bf16 weights), KV budget {args.kv_cache_gb} GiB, "
          f"{args.num_requests} requests (in {args.input_len}, out {args.output_len}), {threads} threads; "
          f"perplexity on {num_words} KJV words ({args.ppl_windows} x {args.ppl_window} tokens)\n\n")
    md += C.md_table(["KV cache", "blocks", "max-len seqs that fit", "peak running", "output tok/s", "total tok/s",
                      "word ppl", "token ppl"], rows)
    rt = data["ratios"]
    md += (f"\n\nint8 / bf16: {rt['blocks']:.2f}x blocks, {rt['peak_running']:.2f}x peak running sequences, "
           f"{rt['output_tok_s']:.2f}x output tok/s; word perplexity {rt['ppl_word_change_pct']:+.3f} % "
           f"(target <= +0.5 %)")
    print("\n" + md)
    C.save_results("kv_int8" + ("_quick" if args.quick else ""), md, data)


if __name__ == "__main__":
    main()
