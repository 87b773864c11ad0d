#!/usr/bin/env python
"""The accepted length stored Medusa / Hydra heads would get on the chat benchmark's own answers, without timing
anything (issue 17).

    python benchmarks/bench_medusa_walk.py --medusa-heads /work/medusa-s16,/work/medusa-s19

The benchmarks' greedy answers to their chat prompts (spec_workloads, EOS ignored, `--output-len` tokens) are recorded
once with the hidden states the engine serves (medusa_distill.HiddenStateRecorder, bf16), then each heads directory's
fitted trees (medusa_config.json `training.trees`) and its chain are walked along those answers the way the engine
walks them (medusa_tree_fit: the proposer's LM head, Hydra heads fed their parent's token). Greedy verification is
deterministic, so the walk is the served mean accepted length with every step drafting, less only the last steps'
clamping by max_tokens: session 19 found 1.646 here against 1.63 served for /work/medusa-s16's "heads:6"
(bench_spec_paired / bench_spec_decode). Beside it, the trainer's held-out walk of the same tree: the gap between the
two is the prompts, not the serving path. Per-prompt lengths show the spread of 8 prompts. Costs ~30 s of CPU; the
bench's prompts are for evaluation only (never fit a tree or train on them).
`--held-out FILE`: the same walks along a trainer's held-out answers (a `--shard-size` data cache's
medusa-heldout-*.pt), over all of them and over the open-chat ones (the closer predictor of the chat benchmark).
Writes benchmarks/results/medusa_walk_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse

import torch

import common as C
import spec_workloads as W

SIZES = ("chain", "4", "6", "8", "12")


def record(prompts: list[list[int]], output_len: int) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: (its last token + the greedy answer, [len(answer), H] served states h_t that chose each token)."""
    from pagellm import SamplingParams
    from pagellm.spec_decode.medusa_distill import HiddenStateRecorder

    llm = C.make_llm("default", max_model_len=max(map(len, prompts)) + output_len + 16, max_num_seqs=1, kv_gb=0.5)
    recorder = HiddenStateRecorder()
    llm.llm_engine.set_proposer(recorder, disable_by_batch_size=1 << 30)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    out = []
    for p in prompts:
        res = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        states = recorder.take(res.request_id)
        out.append(([p[-1]] + list(res.outputs[0].token_ids), torch.stack([states[k] for k in sorted(states)])))
    llm.shutdown()
    return out


def walk_answers(heads, lm_head, to_ids, answers) -> tuple[dict[str, float], list[float]]:
    """({size: mean accepted length over all answers}, [the stored 6-node tree's per answer])."""
    from pagellm.spec_decode.medusa_tree import MedusaTree
    from pagellm.spec_decode.medusa_tree_fit import full_tree, path_hits, tree_runs, walk

    full = full_tree(4, heads.num_heads)
    trees = heads.training_info.get("trees", {})
    per_answer, hits_of = [], []
    for ids, states in answers:
        flat = torch.arange(len(states))  # h_t for t = 0 .. len - 2 chose token t + 1; a path past the end misses
        hits_of.append(path_hits(heads, lm_head, states[None].to(torch.bfloat16), torch.tensor([ids]), flat, full,
                                 to_ids))

    def walked(paths, rows) -> float:
        sub = MedusaTree.from_spec([tuple(p) for p in paths])
        keep = [full.paths.index(p) for p in sub.paths]
        flat = torch.cat([torch.arange(len(h)) + 2 * i * 10_000 for i, h in enumerate(rows)])  # gaps: answers apart
        return walk(flat, tree_runs(sub, torch.cat(rows)[:, keep]).tolist())["accepted_len"]

    out = {n: walked(trees[n]["paths"], hits_of) for n in SIZES if n in trees}
    if "6" in trees:
        per_answer = [walked(trees["6"]["paths"], [h]) for h in hits_of]
    return out, per_answer


def held_out_walks(heads, lm_head, to_ids, held: tuple, is_chat: list[bool]) -> dict[str, dict[str, float]]:
    """The stored trees and chain walked along a trainer's held-out answers (a data cache's held-out tuple: ids,
    states, positions, answers laid end to end in prompt order), over all answers and over the open-chat ones
    (`is_chat`, per prompt): {"all" | "chat": {size: mean accepted length}}. Unlike the trainer's stored walk
    (its first 6000 positions) every position counts."""
    from pagellm.spec_decode.medusa_tree import MedusaTree
    from pagellm.spec_decode.medusa_tree_fit import full_tree, path_hits, tree_runs, walk

    ids, hidden, flat = held[0], held[1], held[2]
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(flat[1:] - flat[:-1] > 1).flatten() + 1])
    if len(starts) != len(is_chat):
        raise ValueError(f"{len(starts)} held-out answers with positions, {len(is_chat)} prompts: cannot tell kinds")
    answer_of = torch.zeros(len(flat), dtype=torch.long)
    answer_of[starts[1:]] = 1
    chat = torch.tensor(is_chat)[answer_of.cumsum(0)]
    full = full_tree(4, heads.num_heads)
    hits = path_hits(heads, lm_head, hidden.to(torch.bfloat16), ids, flat, full, to_ids)
    out: dict[str, dict[str, float]] = {"all": {}, "chat": {}}
    for n, tree in heads.training_info.get("trees", {}).items():
        if n not in SIZES:
            continue
        sub = MedusaTree.from_spec([tuple(p) for p in tree["paths"]])
        runs = tree_runs(sub, hits[:, [full.paths.index(p) for p in sub.paths]])
        out["all"][n] = walk(flat, runs.tolist())["accepted_len"]
        out["chat"][n] = walk(flat[chat], runs[chat].tolist())["accepted_len"]
    return out


def held_out_set(path: str, num_prompts: int, seed: int) -> tuple[tuple, list[bool]]:
    """(a data cache's held-out tuple, whether each of its prompts is open chat): medusa_prompts' held-out list."""
    from pagellm.spec_decode.medusa_prompts import chat_prompts, distill_prompts

    chat = set(chat_prompts(True))
    return torch.load(path), [p in chat for p in distill_prompts(num_prompts, True, seed)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--medusa-heads", required=True, help="comma-separated heads directories (train-medusa outputs)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--tag", default="medusa")
    ap.add_argument("--held-out", default=None,
                    help="a data cache's medusa-heldout-*.pt (train-medusa --shard-size): also walk every heads' "
                         "trees along it, all answers and open chat only")
    ap.add_argument("--held-out-prompts", type=int, default=160, help="--held-out: the set's --num-eval-seqs")
    ap.add_argument("--held-out-seed", type=int, default=0, help="--held-out: the set's --seed")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from pagellm.spec_decode.hydra_heads import HydraHeads, load_draft_heads
    from pagellm.spec_decode.medusa_train import load_base, served_lm_head

    tok, _ = C.load_tokenizer_for_prompts()
    prompts = [p.token_ids for p in W.workloads(tok, args.num_prompts, args.output_len, names=("chat",))["chat"]]
    answers = record(prompts, args.output_len)
    _, base = load_base(None)  # the default model's HF weights: its LM head and token embedding (fp32)
    lm_weight = base.get_output_embeddings().weight.detach().float()
    held_set = held_out_set(args.held_out, args.held_out_prompts, args.held_out_seed) if args.held_out else None
    rows, results, held_rows = [], [], []
    for d in [x for x in args.medusa_heads.split(",") if x]:
        heads = load_draft_heads(d, dtype=torch.float32)
        if isinstance(heads, HydraHeads):
            heads.set_embedding(base.get_input_embeddings().weight)
        vocab = heads.draft_vocab
        bench, per_answer = walk_answers(heads, served_lm_head(heads, lm_weight),
                                         None if vocab is None else (lambda i, v=vocab: v[i]), answers)
        held = {n: t["accepted_len"] for n, t in heads.training_info.get("trees", {}).items() if n in SIZES}
        results.append({"heads": d, "bench_walk": bench, "held_out_walk": held, "per_answer_tree6": per_answer})
        if held_set is not None:
            walks = held_out_walks(heads, served_lm_head(heads, lm_weight),
                                   None if vocab is None else (lambda i, v=vocab: v[i]), *held_set)
            results[-1]["held_out_cache_walk"] = walks
            held_rows.append([d] + [f"{walks['all'][n]:.3f} / {walks['chat'][n]:.3f}" if n in walks["all"] else "-"
                                    for n in SIZES])
        rows.append([d] + [f"{bench[n]:.3f} ({held[n]:.3f})" if n in bench and n in held else "-" for n in SIZES]
                    + [" / ".join(f"{x:.2f}" for x in per_answer)])
    md = "\n".join([f"# Heads walked along the chat benchmark's answers ({args.tag})", "",
                    f"{args.num_prompts} chat prompts x {args.output_len} greedy tokens (EOS ignored), served bf16 "
                    f"states; mean accepted length with every step drafting (the trainer's held-out walk)", "",
                    C.md_table(["heads"] + [f"{'chain' if n == 'chain' else 'tree heads:' + n}" for n in SIZES]
                               + ["heads:6 per prompt"], rows)])
    if held_rows:
        md += "\n\n" + "\n".join([f"Walked along {args.held_out} (all {args.held_out_prompts} held-out answers / "
                                   "open chat only, every position):", "",
                                   C.md_table(["heads"] + [f"{'chain' if n == 'chain' else 'tree heads:' + n}"
                                                           for n in SIZES], held_rows)])
    print("\n" + md, flush=True)
    C.save_results(f"medusa_walk_{args.tag}", md, {"tag": args.tag, "env": C.env_info(), "args": vars(args),
                                                    "results": results})


if __name__ == "__main__":
    main()
