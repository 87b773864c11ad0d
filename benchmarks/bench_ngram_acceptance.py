#!/usr/bin/env python
"""Offline acceptance of ngram chains and candidate trees on the default model's own greedy outputs (issue 17).

    python benchmarks/bench_ngram_acceptance.py                        # copy prompts, each answer to EOS
    python benchmarks/bench_ngram_acceptance.py --workload chat --costs 0.03,0.1 --output-len 96

One plain greedy generation per prompt (spec_workloads.py's workloads, bf16; copy: to EOS within its max_tokens,
copy14 / chat: --output-len tokens) gives the sequence a lossless
speculative run must reproduce. Each configuration is then replayed without the model: at every step the proposer
sees prompt + the tokens committed so far, drafts a chain (find_ngram_continuation) or a tree
(ngram_candidate_tree), and the step commits the longest draft path equal to the true continuation plus one token
(what greedy verification commits). Reported: tokens per step, and the decode speed-up under a verify cost model
(a step of 1 + d tokens costs 1 + c d plain steps, c per --costs; a step without drafts costs 1), which says how
cheap a draft token must be for a configuration to pay. "fixed" / "match" / "cost" replay NgramProposer itself (its
incremental matchers; draft_length "fixed", "match" or "cost", the last with draft_token_cost = each column's c, a
proposer per column: its tokens / step is the first column's); "oracle" drafts, at every step, the longest true
continuation that follows any earlier occurrence of the last token (what no single-chain lookup can beat). No timing: the numbers do not depend on the machine's load.
Writes benchmarks/results/ngram_acceptance_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse

import common as C
import numpy as np
import spec_workloads as W

CONFIGS = (("chain", 3, 3), ("chain", 4, 4), ("chain", 6, 6), ("chain", 8, 8), ("tree", 3, 4), ("tree", 3, 6),
           ("tree", 4, 6), ("tree", 4, 8), ("tree", 6, 10), ("tree", 8, 16),
           # NgramProposer itself (incremental matchers): draft_length "fixed" / "match" (as many as the match agreed)
           ("fixed", 3, 3), ("fixed", 8, 8), ("fixed", 12, 12), ("match", 3, 3), ("match", 8, 8), ("match", 12, 12),
           ("match", 16, 16), ("cost", 8, 8), ("cost", 12, 12), ("cost", 16, 16), ("cost", 24, 24), ("oracle", 0, 0))


def replay(pairs: list[tuple[list[int], list[int]]], kind: str, k: int, nodes: int, lo: int, hi: int,
           cost: float | None = None) -> list[int]:
    """Per step of a lossless speculative run: its number of draft tokens and tokens committed (pairs)."""
    from pagellm.spec_decode.ngram_match import find_ngram_continuation, ngram_candidate_tree

    from pagellm.spec_decode import DraftRequest
    from pagellm.spec_decode.ngram import NgramProposer

    steps = []
    proposer = None  # one for all prompts, as in a server: "cost" learns across requests
    if kind in ("fixed", "match", "cost"):
        proposer = NgramProposer(k, lo, hi, draft_length=kind, draft_token_cost=cost if kind == "cost" else None)
    for n_seq, (prompt, out) in enumerate(pairs):
        seq, i, sid = list(prompt), 0, f"s{n_seq}"
        while i < len(out):
            ids = np.asarray(seq, dtype=np.int64)
            if proposer is not None:  # the room max_tokens leaves (DraftRequest.for_sequence)
                req = DraftRequest(sid, prompt, seq[len(prompt) :], max_num_drafts=min(k, len(out) - i - 1))
                drafts = proposer.propose([req]).get(sid, []) if req.max_num_drafts > 0 else []
                parents = list(range(-1, len(drafts) - 1))
            elif kind == "oracle":  # the best any single earlier occurrence of the last token could have drafted
                drafts = max(([seq[e + 1 + j] for j in range(_agreeing(seq, e, out, i))] for e in range(len(seq) - 1)
                              if seq[e] == seq[-1]), key=len, default=[])
                parents = list(range(-1, len(drafts) - 1))
            elif kind == "chain":
                drafts = find_ngram_continuation(ids, lo, hi, k).tolist()
                parents = list(range(-1, len(drafts) - 1))
            else:
                drafts, parents = ngram_candidate_tree(ids, lo, hi, k, nodes)
            depth = {-1: 0}  # accepted nodes -> their depth
            for j, (t, p) in enumerate(zip(drafts, parents)):
                if p in depth and i + depth[p] < len(out) and out[i + depth[p]] == t:
                    depth[j] = depth[p] + 1
            n = min(max(depth.values()) + 1, len(out) - i)
            steps.append((len(drafts), n))
            seq += out[i : i + n]
            i += n
    return steps


def _agreeing(seq: list[int], end: int, out: list[int], i: int) -> int:
    """How many of the true next tokens out[i:] follow position `end` in seq."""
    a = 0
    while i + a < len(out) and end + 1 + a < len(seq) and seq[end + 1 + a] == out[i + a]:
        a += 1
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=W.WORKLOADS, default="copy")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=96, help="copy14 / chat: new tokens per request")
    ap.add_argument("--costs", type=lambda s: [float(x) for x in s.split(",")], default=[0.03, 0.08, 0.15],
                    help="verify cost per draft token, in plain decode steps")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args()
    from pagellm import SamplingParams

    tok, _ = C.load_tokenizer_for_prompts()
    prompts = W.workloads(tok, args.num_prompts, args.output_len, names=(args.workload,))[args.workload]
    llm = C.make_llm("default", max_model_len=max(len(p.token_ids) + p.max_tokens for p in prompts) + 16,
                     max_num_seqs=len(prompts), kv_gb=0.5)
    sp = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=p.ignore_eos, detokenize=False)
          for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p.token_ids} for p in prompts], sp, use_tqdm=False)
    pairs = [(list(p.token_ids), list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    rows, results = [], []
    for kind, k, nodes in CONFIGS:
        steps = replay(pairs, kind, k, nodes, 1, 4, args.costs[0])
        committed = sum(n for _, n in steps)
        drafted = sum(1 for d, _ in steps if d)
        per_cost = [replay(pairs, kind, k, nodes, 1, 4, c) if kind == "cost" else steps for c in args.costs]
        speed = [committed / sum(1 + c * d for d, _ in s) for c, s in zip(args.costs, per_cost)]
        results.append({"kind": kind, "k": k, "tree_nodes": nodes, "steps": len(steps), "drafted_steps": drafted,
                        "tokens_per_step": committed / len(steps), "speedup": dict(zip(map(str, args.costs), speed))})
        rows.append([kind, k or "-", nodes if kind == "tree" else "-", f"{committed / len(steps):.2f}",
                     f"{drafted / len(steps):.0%}"] + [f"{s:.2f}x" for s in speed])
    tag = args.tag or args.workload
    md = "\n".join([f"# ngram acceptance offline ({tag})", "",
                    f"Default model bf16, {len(prompts)} {args.workload} prompts, {sum(len(o) for _, o in pairs)} greedy tokens "
                    "in all (copy: each answer to EOS; copy14 / chat: --output-len each), "
                    "prompt_lookup_min 1, max 4. Speed-up: tokens per step over steps' cost (1 + c per draft token).",
                    "", C.md_table(["drafts", "k", "tree_nodes", "tokens / step", "steps with drafts"]
                                   + [f"speed-up at c = {c}" for c in args.costs], rows)])
    print("\n" + md, flush=True)
    C.save_results(f"ngram_acceptance_{tag}", md, {"tag": tag, "env": C.env_info(), "args": vars(args),
                                                   "results": results})


if __name__ == "__main__":
    main()
