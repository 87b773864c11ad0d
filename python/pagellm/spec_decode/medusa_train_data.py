"""The settings (`MedusaTrainConfig`) and data `pagellm train-medusa` trains Medusa heads on (medusa_train.py): token
windows of the machine's texts (`kjv`, `pydoc`), the base model's own greedy continuations of KJV prompts (`self`),
its answers to chat-templated questions (`chat`, medusa_chat_data.py), or pagellm's own answers to many varied
prompts with the hidden states it served them with (`distill`: medusa_prompts.py, medusa_distill.py); the others
with the base's final normed hidden states
(HF transformers, float32: `model.model(...).last_hidden_state`, what pagellm's ModelRunner returns for the
same weights), computed once per run or kept in a cache directory (`--data-cache`).
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

import torch

DATA_SOURCES = ("kjv", "pydoc", "self", "chat", "distill")
HEAD_TYPE_NAMES = ("medusa", "hydra")  # hydra_heads.HEAD_TYPES (named here: the data module imports no heads)
SELF_PROMPT_LEN = 16  # tokens of text before the base model's own continuation (--data self)


LR_SCHEDULES = ("constant", "cosine")


@dataclass
class MedusaTrainConfig:
    """Hyper-parameters; the defaults take a few minutes on 2 CPU cores for the default model."""

    num_heads: int = 3
    num_layers: int = 1
    share_lm_head: bool = True  # False: Medusa's own LM head per head (3x the time and memory)
    steps: int = 300
    seq_len: int = 128
    num_train_seqs: int = 96  # windows of seq_len tokens whose hidden states are precomputed
    num_eval_seqs: int = 16
    batch_size: int = 128  # positions per step
    lr: float = 5e-3  # ResBlocks start at zero: a few hundred steps need a brisk rate
    weight_decay: float = 0.0
    warmup_steps: int = 20
    # "cosine": after the warm-up the rate decays along a half cosine to LR_FLOOR x lr at the last step (s15's
    # held-out score was still creeping up at a constant rate; a decay lets a longer run settle)
    lr_schedule: str = "constant"
    # heads to start from (a `train-medusa` output of the same kind, sizes and draft vocabulary): continue a training
    init_from: str | None = None
    data: str = "self"  # self-distillation: drafts are judged against the model's outputs, not the text's
    draft_vocab_size: int = 0  # > 0: drafting scores only the most frequent tokens of the training labels
    eval_every: int = 50  # > 0: evaluate every N steps, keep the heads of the best held-out score (0: the last)
    seed: int = 0
    head_type: str = "medusa"  # "hydra": heads that read the drafted tokens (hydra_heads.py)
    # --data distill: the share of training prompts answered by sampling (the rest greedy; held out: greedy)
    sampled_fraction: float = 0.25
    sample_temperature: float = 0.7
    # the verify step's cost per extra query row, relative to a plain step (bench_verify_rows.py's c; session 14,
    # 2-core EPYC: 0.05-0.07; session 16, Hydra heads served at batch 1 on chat, bench_spec_paired.py: a step of 4 / 5 /
    # 7 / 9 / 13 rows cost 1.22 / 1.26 / 1.26 / 1.39 / 1.55x a plain one, the heads and bookkeeping included, ~0.035 a
    # row): sizes the tree stored as "served" (medusa_tree_fit.py)
    tree_row_cost: float = 0.035
    # > 0: each head's loss mixes in KL(target || head) against the target's whole distribution at the position
    # it guesses, (1 - w) * CE + w * KL (medusa_train.medusa_loss): distillation beyond the argmax labels
    kl_weight: float = 0.0
    # --data distill, > 0: the training prompts answered and cached in shards of this many (medusa_data_shards.py)
    shard_size: int = 0

    def check(self) -> None:
        if self.data not in DATA_SOURCES:
            raise ValueError(f"data must be one of {DATA_SOURCES}, got {self.data!r}")
        if self.head_type not in HEAD_TYPE_NAMES:
            raise ValueError(f"head_type must be one of {HEAD_TYPE_NAMES}, got {self.head_type!r}")
        if self.head_type == "hydra" and not self.share_lm_head:
            raise ValueError("hydra heads share the target's LM head: drop own LM heads")
        for name in ("num_heads", "num_layers", "steps", "num_train_seqs", "num_eval_seqs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        min_len = self.num_heads + 3 + (SELF_PROMPT_LEN if self.data == "self" else 0)
        if self.seq_len < min_len:
            raise ValueError(f"seq_len={self.seq_len} is too short for {self.num_heads} heads")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not 0.0 <= self.kl_weight <= 1.0:
            raise ValueError(f"kl_weight must be in [0, 1], got {self.kl_weight}")
        if not self.tree_row_cost >= 0:
            raise ValueError(f"tree_row_cost must be >= 0, got {self.tree_row_cost}")
        if not 0.0 <= self.sampled_fraction <= 1.0 or not self.sample_temperature > 0:
            raise ValueError(f"sampled_fraction must be in [0, 1] and sample_temperature > 0, got "
                             f"{self.sampled_fraction}, {self.sample_temperature}")
        if self.shard_size < 0 or (self.shard_size and self.data != "distill"):
            raise ValueError(f"shard_size must be >= 0 (> 0 with data 'distill' only), got {self.shard_size}")
        if self.draft_vocab_size < 0 or (self.draft_vocab_size and not self.share_lm_head):
            raise ValueError(f"draft_vocab_size must be >= 0 and needs a shared LM head, got {self.draft_vocab_size}")


def _windows(texts: list[str], tokenizer, count: int, seq_len: int, rng: random.Random) -> list[list[int]]:
    """`count` windows of seq_len token ids at seeded offsets of seeded documents (BOS first when the
    tokenizer has one)."""
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    docs = [ids for ids in (tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts)
            if len(ids) >= seq_len - len(bos)]
    if not docs:
        raise ValueError(f"no training document has {seq_len} tokens; use a smaller seq_len")
    out = []
    for _ in range(count):
        ids = docs[rng.randrange(len(docs))]
        start = rng.randrange(len(ids) - (seq_len - len(bos)) + 1)
        out.append(bos + ids[start : start + seq_len - len(bos)])
    return out


def _source_texts(source: str, held_out: bool) -> list[str]:
    """Training (or held-out) documents of a text source."""
    from pagellm.quantization import calibration_data as cd  # noqa: PLC0415

    if source == "pydoc":
        pages = cd.doc_pages()
        if not pages:
            raise FileNotFoundError("--data pydoc needs python3.11-doc (apt-get install python3.11-doc)")
        if held_out:  # the page calibration_data holds out (a sibling of the pages it lists)
            held = {Path(str(p).split("/_sources/")[0]) / "_sources" / cd.HELD_OUT_DOC_PAGES[0] for p in pages}
            pages = sorted(p for p in held if p.is_file()) or pages[-2:]
        else:
            pages = pages[::7][:60]  # a spread of pages; tokenizing them all costs minutes
        return [p.read_text(errors="replace") for p in pages]
    if held_out:
        raw = subprocess.run(["bible", "Eccl1:1-Eccl12:14"], capture_output=True, text=True, timeout=60).stdout
        return list(cd.parse_bible_output(raw).values())
    docs = cd.kjv_documents()
    if not docs:
        raise FileNotFoundError("--data kjv / self needs Debian's bible-kjv (apt-get install bible-kjv)")
    return docs


def build_windows(tokenizer, config: MedusaTrainConfig, held_out: bool) -> list[list[int]]:
    """Token windows for training or evaluation (for `self`: the prompts, continued later)."""
    source = "kjv" if config.data == "self" else config.data
    rng = random.Random(config.seed + (1 if held_out else 0))
    count = config.num_eval_seqs if held_out else config.num_train_seqs
    length = SELF_PROMPT_LEN if config.data == "self" else config.seq_len
    return _windows(_source_texts(source, held_out), tokenizer, count, length, rng)


@torch.no_grad()
def greedy_continuations(base, prompts: torch.Tensor, total_len: int, batch: int = 32) -> torch.Tensor:
    """[N, P] equal-length prompts -> [N, total_len]: each continued greedily by the base model."""
    outs = []
    for chunk in prompts.split(batch):
        out = base.generate(chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=total_len - chunk.shape[1],
                            min_new_tokens=total_len - chunk.shape[1], do_sample=False, pad_token_id=0)
        outs.append(out[:, :total_len])
    return torch.cat(outs)


@torch.no_grad()
def chat_answers(base, tokenizer, prompts: list[list[int]], answer_len: int, batch: int = 16) -> list[list[int]]:
    """Each prompt + the base model's greedy answer: up to its first EOS (kept), at most answer_len tokens.
    Prompts of different lengths are left-padded within a batch (the attention mask hides the pads)."""
    eos = base.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (min(eos_ids) if eos_ids else 0)
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        gen = base.generate(ids, attention_mask=mask, max_new_tokens=answer_len, do_sample=False, pad_token_id=pad)
        for p, row in zip(chunk, gen[:, width:].tolist()):
            cut = next((j + 1 for j, tok in enumerate(row) if tok in eos_ids), len(row))
            out.append(p + row[:cut])
    return out


@torch.no_grad()
def final_hidden_states(base, token_ids: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """[N, T] -> [N, T, H] float32: the base's final normed hidden states (its LM head's input)."""
    return torch.cat([base.model(chunk).last_hidden_state.float() for chunk in token_ids.split(batch)])


AnswerFn = Callable[[list[list[int]], int], list[list[int]]]  # (prompts, answer_len) -> prompt + answer each


def ragged_positions(lengths: list[int], starts: list[int], num_heads: int) -> torch.Tensor:
    """Sequences laid end to end: the flat positions t of each (length L, first trained position s) with
    s <= t and t + num_heads + 1 < L, so no label crosses into the next sequence."""
    out, offset = [], 0
    for length, start in zip(lengths, starts):
        first, end = max(0, start), length - num_heads - 1
        out.append(torch.arange(first, max(first, end)) + offset)
        offset += length
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def chat_training_data(base, tokenizer, config: MedusaTrainConfig, held_out: bool, say: Callable[[str], None],
                       answer_fn: AnswerFn | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`--data chat`: ([1, S] token ids, [1, S, H] hidden states, flat trained positions) of chat turns laid
    end to end; a turn's positions start at its prompt's last token (the first whose next token is answer).
    `answer_fn`: who answers (`pagellm train-medusa` passes the engine: the answers the heads will meet when
    serving, and far faster than HF generate on a CPU); default: HF greedy decoding of `base` (chat_answers)."""
    from pagellm.spec_decode.medusa_chat_data import chat_prompt_ids, chat_questions  # noqa: PLC0415

    count = config.num_eval_seqs if held_out else config.num_train_seqs
    prompts = chat_prompt_ids(tokenizer, chat_questions(count, held_out, config.seed))
    say(f"chat self-distillation: answering {len(prompts)} {'held-out ' if held_out else ''}questions "
        f"(up to {config.seq_len} tokens each)")
    seqs = (answer_fn or (lambda ps, n: chat_answers(base, tokenizer, ps, n)))(prompts, config.seq_len)
    if any(q[: len(p)] != p for p, q in zip(prompts, seqs)) or len(seqs) != len(prompts):
        raise ValueError("answer_fn must return each prompt followed by its answer")
    hidden = torch.cat([final_hidden_states(base, torch.tensor([q]))[0] for q in seqs])
    positions = ragged_positions([len(q) for q in seqs], [len(p) - 1 for p in prompts], config.num_heads)
    return torch.tensor([sum(seqs, [])]), hidden[None], positions


# (prompts, answer_len, temperature) -> medusa_distill.DistillSequence per prompt (the engine's answers and states)
RecordFn = Callable[[list[list[int]], int, float], list]


def distill_training_data(tokenizer, config: MedusaTrainConfig, held_out: bool, say: Callable[[str], None],
                          record_fn: RecordFn | None) -> tuple[torch.Tensor, ...]:
    """`--data distill`: ([1, S] token ids, [1, S, H] bf16 hidden states, flat trained positions, [1, S] greedy
    labels) of the engine's answers to medusa_prompts' prompts, recorded as served (medusa_distill.py). Each answer
    is kept from its prompt's last token on (earlier positions never train), answers laid end to end. Training: a
    `sampled_fraction` of the prompts answered by sampling; held out: greedy answers only."""
    from pagellm.spec_decode.medusa_chat_data import chat_prompt_ids  # noqa: PLC0415
    from pagellm.spec_decode.medusa_prompts import distill_prompts  # noqa: PLC0415

    if record_fn is None:
        raise ValueError("--data distill needs the engine's answers (record_fn, entrypoints/train_medusa.py)")
    count = config.num_eval_seqs if held_out else config.num_train_seqs
    return answer_distill_prompts(chat_prompt_ids(tokenizer, distill_prompts(count, held_out, config.seed)), config,
                                  held_out, say, record_fn)


def distill_prompt_ids(tokenizer, config: MedusaTrainConfig) -> list[list[int]]:
    """The training prompts of `--data distill`, chat-templated token ids (the list medusa_data_shards cuts)."""
    from pagellm.spec_decode.medusa_chat_data import chat_prompt_ids  # noqa: PLC0415
    from pagellm.spec_decode.medusa_prompts import distill_prompts  # noqa: PLC0415

    return chat_prompt_ids(tokenizer, distill_prompts(config.num_train_seqs, False, config.seed))


def answer_distill_prompts(prompts: list[list[int]], config: MedusaTrainConfig, held_out: bool,
                           say: Callable[[str], None], record_fn: RecordFn | None) -> tuple[torch.Tensor, ...]:
    """distill_training_data's tuple for these prompts: training, the first `sampled_fraction` of them sampled."""
    if record_fn is None:
        raise ValueError("--data distill needs the engine's answers (record_fn, entrypoints/train_medusa.py)")
    num_sampled = 0 if held_out else int(round(len(prompts) * config.sampled_fraction))
    say(f"distillation: the engine answers {len(prompts)} {'held-out ' if held_out else ''}prompts "
        f"({num_sampled} sampled at temperature {config.sample_temperature}, up to {config.seq_len} tokens each)")
    seqs = record_fn(prompts[num_sampled:], config.seq_len, 0.0)
    if num_sampled:
        seqs += record_fn(prompts[:num_sampled], config.seq_len, config.sample_temperature)
    cut = [s.prompt_len - 1 for s in seqs]
    ids = [s.token_ids[c:] for s, c in zip(seqs, cut)]
    positions = ragged_positions([len(q) for q in ids], [0] * len(ids), config.num_heads)
    hidden = torch.cat([s.hidden[c:].to(torch.bfloat16) for s, c in zip(seqs, cut)])  # what the proposer is handed
    return (torch.tensor([sum(ids, [])]), hidden[None],
            positions, torch.tensor([sum((s.label_ids[c:] for s, c in zip(seqs, cut)), [])]))


def training_data(base, tokenizer, config: MedusaTrainConfig, held_out: bool, say: Callable[[str], None],
                   answer_fn: AnswerFn | None, record_fn: RecordFn | None = None) -> tuple[torch.Tensor, ...]:
    """(token ids, hidden states, trained positions or None[, greedy labels]) of the training or held-out set."""
    if config.data == "distill":
        return distill_training_data(tokenizer, config, held_out, say, record_fn)
    if config.data == "chat":
        return chat_training_data(base, tokenizer, config, held_out, say, answer_fn)
    ids = torch.tensor(build_windows(tokenizer, config, held_out), dtype=torch.long)
    if config.data == "self":
        say(f"self-distillation: continuing {len(ids)} prompts to {config.seq_len} tokens")
        ids = greedy_continuations(base, ids, config.seq_len)
    return ids, final_hidden_states(base, ids), None


def sharded_training_data(caches: list, model: str | None, config: MedusaTrainConfig, tokenizer,
                          say: Callable[[str], None], record_fn: RecordFn | None, shards: str | None,
                          load: bool = True) -> dict | None:
    """`--shard-size`: answer the listed shards (`shards`: medusa_data_shards.parse_shards' spec) and the held-out
    set where no cache holds them, then (`load`) the held-out set and every shard found in `caches`."""
    from pagellm.spec_decode import medusa_data_shards as S  # noqa: PLC0415

    def answer(prompts: list[list[int]] | None, held_out: bool) -> tuple:
        if held_out:
            return distill_training_data(tokenizer, config, True, say, record_fn)
        return answer_distill_prompts(prompts, config, False, say, record_fn)

    S.answer_shards(caches, model, config, S.parse_shards(shards, S.num_shards(config)), answer,
                    lambda: distill_prompt_ids(tokenizer, config), say)
    return S.load_shards(caches, model, config, say) if load else None


def cached_training_data(cache: str | Path | None, model: str | None, config: MedusaTrainConfig, compute: Callable) -> dict:
    """compute() once per (model, data settings) when a cache directory is given."""
    if cache is None:
        return compute()
    keys = ("data", "seq_len", "num_train_seqs", "num_eval_seqs", "num_heads", "seed")
    if config.data == "distill":
        keys += ("sampled_fraction", "sample_temperature")
    key = hashlib.sha256(json.dumps([str(model), *(getattr(config, k) for k in keys)]).encode()).hexdigest()[:16]
    path = Path(cache).expanduser() / f"medusa-data-{key}.pt"
    if path.is_file():
        return torch.load(path)
    data = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)
    return data
