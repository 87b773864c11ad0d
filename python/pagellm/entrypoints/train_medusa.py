"""`pagellm train-medusa --output DIR`: train Medusa heads on a frozen model (spec_decode/medusa_train.py).

    pagellm train-medusa --output /tmp/smollm2-medusa          # default model, self-distillation, ~5 min on 2 cores
    pagellm train-medusa --output DIR --model ./my-llama --data kjv --num-heads 4 --steps 600
    pagellm train-medusa --output DIR --data chat --num-train-seqs 256 --steps 1000   # heads for chat serving
    pagellm train-medusa --output DIR --data chat --head-type hydra                  # heads that read their drafts
    pagellm train-medusa --output DIR --data distill --num-train-seqs 2400 --head-type hydra  # many varied prompts
    pagellm train-medusa --output DIR --data distill --num-train-seqs 13400 --shard-size 400 --data-cache C \
        --answer-shards 0-9 --data-only       # answer 10 shards into C (rerun / other processes: other shards)

The heads load with LLM(model, speculative_config={"method": "medusa", "num_speculative_tokens": 3,
"model": DIR}). Layout of DIR: spec_decode/medusa_heads.py.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time


def run(a: argparse.Namespace) -> int:
    from pagellm.spec_decode.medusa_train import MedusaTrainConfig, train_medusa  # noqa: PLC0415

    config = MedusaTrainConfig(num_heads=a.num_heads, num_layers=a.num_layers, share_lm_head=not a.own_lm_heads,
                               steps=a.steps, seq_len=a.seq_len, num_train_seqs=a.num_train_seqs, lr=a.lr,
                               num_eval_seqs=a.num_eval_seqs,
                               batch_size=a.batch_size, data=a.data, seed=a.seed, weight_decay=a.weight_decay,
                               draft_vocab_size=a.draft_vocab_size, eval_every=a.eval_every,
                               head_type=a.head_type, sampled_fraction=a.sampled_fraction,
                               sample_temperature=a.sample_temperature, tree_row_cost=a.tree_row_cost,
                               lr_schedule=a.lr_schedule, init_from=a.init_from, kl_weight=a.kl_weight,
                               shard_size=a.shard_size)
    start = time.perf_counter()
    answer_fn = engine_answers(a.model, a.answer_dtype) if a.data == "chat" else None
    say = lambda msg: print(f"[medusa] {msg}", flush=True)  # noqa: E731
    record_fn = engine_recorder(a.model, a.answer_dtype, a.answer_batch, say, a.answer_kv_gb) \
        if a.data == "distill" else None
    caches = [c for c in (a.data_cache or "").split(",") if c]
    out, _ = train_medusa(a.output, a.model, config, progress=say, answer_fn=answer_fn, data_cache=caches,
                          record_fn=record_fn, answer_shards=a.answer_shards, data_only=a.data_only)
    done = f"wrote {out}" if out is not None else "answered the shards"
    print(f"[medusa] {done} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0


def engine_answers(model: str | None, dtype: str):
    """`--data chat`'s answers from pagellm itself: greedy, to the first EOS, at most answer_len tokens (the
    engine is started on first use and shut down after each call)."""

    def answer(prompts: list[list[int]], answer_len: int) -> list[list[int]]:
        from pagellm import LLM, SamplingParams  # noqa: PLC0415

        llm = LLM(model, dtype=dtype)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=answer_len), use_tqdm=False)
            return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        finally:
            llm.shutdown()

    return answer


def engine_recorder(model: str | None, dtype: str, max_num_seqs: int, say, kv_gb: float | None = None):
    """`--data distill`'s answers and hidden states, recorded while pagellm answers (spec_decode/medusa_distill.py);
    an engine per call, shut down after it (the heads train with its memory free)."""

    def record(prompts: list[list[int]], answer_len: int, temperature: float) -> list:
        from pagellm import LLM  # noqa: PLC0415
        from pagellm.spec_decode.medusa_distill import record_answers  # noqa: PLC0415

        llm = LLM(model, dtype=dtype, max_num_seqs=max_num_seqs, kv_cache_memory_gb=kv_gb)
        try:
            return record_answers(llm, prompts, answer_len, temperature, say=say)
        finally:
            llm.shutdown()
            del llm
            gc.collect()  # the engine's reference cycles kept each call's KV cache (4 GiB on CPU) alive: 12 GB by the third

    return record


def add_train_medusa_parser(subparsers) -> argparse.ArgumentParser:
    from pagellm.spec_decode.medusa_train_data import DATA_SOURCES, HEAD_TYPE_NAMES, LR_SCHEDULES, MedusaTrainConfig  # noqa: PLC0415

    d = MedusaTrainConfig()
    p = subparsers.add_parser("train-medusa", help="train Medusa heads (speculative decoding) on a frozen model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="directory for medusa_lm_head.safetensors + medusa_config.json")
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-heads", type=int, default=d.num_heads, help="heads = the most drafts per step")
    p.add_argument("--num-layers", type=int, default=d.num_layers, help="ResBlocks per head")
    p.add_argument("--head-type", default=d.head_type, choices=HEAD_TYPE_NAMES,
                   help="medusa: heads on the hidden state alone; hydra: each head also reads the token before its "
                        "guess (drafted sequentially; better acceptance)")
    p.add_argument("--own-lm-heads", action="store_true",
                   help="give each head its own LM head (Medusa's reference; default: share the model's)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training window")
    p.add_argument("--num-train-seqs", type=int, default=d.num_train_seqs, help="training windows")
    p.add_argument("--num-eval-seqs", type=int, default=d.num_eval_seqs, help="held-out windows / questions")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="positions per step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--lr-schedule", default=d.lr_schedule, choices=LR_SCHEDULES,
                   help="after the warm-up: constant, or a half cosine down to 5 %% of --lr at the last step")
    p.add_argument("--init-from", default=None,
                   help="start from these heads (a train-medusa output of the same kind and sizes): continue; their "
                        "draft vocabulary is kept when it has --draft-vocab-size tokens")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="AdamW weight decay (hydra heads on a few hundred answers overfit: 0.1 helped)")
    p.add_argument("--data", default=d.data, choices=DATA_SOURCES,
                   help="kjv | pydoc: text on this machine; self: the model's own greedy continuations of KJV "
                        "prompts; chat: the model's own answers to chat-templated questions; distill: pagellm's answers "
                        "(greedy and sampled) to many varied prompts (chat, KJV, Python docs and source), hidden "
                        "states recorded as served")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--answer-dtype", default="bfloat16",
                   help="--data chat: the dtype pagellm answers the questions in (the one you serve with)")
    p.add_argument("--answer-batch", type=int, default=64,
                   help="--data distill: sequences the answering engine runs at once")
    p.add_argument("--sampled-fraction", type=float, default=d.sampled_fraction,
                   help="--data distill: share of training prompts answered by sampling (labels: the greedy tokens)")
    p.add_argument("--sample-temperature", type=float, default=d.sample_temperature,
                   help="--data distill: temperature of the sampled answers (top-p 0.95)")
    p.add_argument("--tree-row-cost", type=float, default=d.tree_row_cost,
                   help="verify cost per extra query row relative to a plain step (benchmarks/bench_verify_rows.py's "
                        "c): picks the fitted tree that '\"tree\": \"heads\"' serves")
    p.add_argument("--kl-weight", type=float, default=d.kl_weight,
                   help="0-1: each head's loss is (1 - w) x CE on the target's greedy tokens + w x KL against the "
                        "target's whole distribution there (its LM head over the recorded states)")
    p.add_argument("--draft-vocab-size", type=int, default=d.draft_vocab_size,
                   help="> 0: draft only the N most frequent tokens of the training labels (a [N, H] LM head "
                        "product per step instead of the whole vocabulary's)")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="evaluate on the held-out set every N steps and keep the best heads (0: keep the last)")
    p.add_argument("--answer-kv-gb", type=float, default=None,
                   help="--data distill: the answering engine's KV-cache budget in GiB (default: the engine's)")
    p.add_argument("--data-cache", default=None,
                   help="directory keeping the answers' token ids and hidden states: a rerun with other training "
                        "settings (steps, lr, draft vocabulary) skips generating them; with --shard-size a "
                        "comma-separated list (shards are answered into the first, read from all)")
    p.add_argument("--shard-size", type=int, default=d.shard_size,
                   help="--data distill: answer and cache the training prompts in shards of this many "
                        "(spec_decode/medusa_data_shards.py): piece by piece, in parallel processes, resumable")
    p.add_argument("--answer-shards", default="all",
                   help="--shard-size: the shards this run answers where no cache holds them: all | none | 0-4,7 "
                        "(training reads every shard found)")
    p.add_argument("--data-only", action="store_true",
                   help="--shard-size: answer the shards and the held-out set, train nothing")
    p.set_defaults(func=run)
    return p
