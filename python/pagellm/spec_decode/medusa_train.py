"""Training Medusa heads (medusa_heads.py) on a frozen base model: `pagellm train-medusa`.

    pagellm train-medusa --output /tmp/smollm2-medusa                # default model, self-distillation
    pagellm train-medusa --output DIR --model ./my-llama --data kjv --num-heads 4 --steps 600

1. Data (token windows of seq_len): `kjv` / `pydoc` are the machine's own texts (quantization/
   calibration_data.py: Debian bible-kjv, python3.11-doc); `self` is self-distillation (Medusa-2): the
   base model's own greedy continuations of KJV prompts, so the heads learn what the model will say;
   `chat` is self-distillation on chat turns (medusa_chat_data.py): user questions through the model's
   chat template and the model's own greedy answer (to its first EOS, at most seq_len tokens); only the
   answer's positions train. Held out for evaluation: Ecclesiastes / the held-out doc page (their
   continuations for `self`), questions on unseen topics for `chat`.
2. The frozen base (HF transformers, float32) computes every window's final normed hidden states once
   (`model.model(...).last_hidden_state`: what pagellm's ModelRunner returns for the same weights).
3. Only the heads train: position t's hidden state h_t; head k (0-based) predicts token t + k + 2 (the
   base's LM head predicts t + 1); loss = sum_k decay^k * CE(head_k(h_t), token_{t+k+2}) (Medusa's
   decay 0.8), AdamW over random batches of positions, linear warm-up.
Evaluation prints each head's top-1 accuracy on the held-out positions (the base LM head's too).

Measured on the default model (SmolLM2-135M, 3 heads, shared LM head, 2 busy CPU cores), held-out top-1
of heads 1/2/3: `--data kjv` 300 steps x 256 positions at lr 1e-3: 0.09 / 0.06 / 0.04 (22 min on loaded
cores; engine acceptance 2.4 %); `--data self` 250 steps x 128 at lr 5e-3: 0.31 / 0.19 / 0.07 (5 min;
engine acceptance 3.7 % on mixed prompts, head 1 right 24 % of the time on a KJV prompt); `--data self`
500 steps x 128 over 128 windows: 0.35 / 0.19 / 0.12 (11.5 min; acceptance 4.1 %). Text labels teach the
heads the text, not the model: self-distillation is the default. The heads are small and briefly
trained: useful acceptance needs own LM heads (`--own-lm-heads`) and far more steps than a CPU run.
The train/inference path itself agrees (tests/engine/test_spec_medusa.py: the engine's drafts are the heads'
top-1 on the trainer's hidden states, labels t + k + 2 are the verified tokens; on the default model the
engine's bf16 hidden states have cosine 0.9998 with the trainer's fp32 ones, head-1 agreement 0.24 vs 0.27 on
a KJV prompt): the gap is the held-out set (greedy KJV continuations, often loops) vs other prompts.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.nn import functional as F

from pagellm.spec_decode.medusa_heads import MedusaHeads, base_model_hash, draft_vocab_lm_head

DATA_SOURCES = ("kjv", "pydoc", "self", "chat")
MEDUSA_DECAY = 0.8  # Medusa's medusa_decay_coefficient: later heads weigh less
SELF_PROMPT_LEN = 16  # tokens of text before the base model's own continuation (--data self)


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
    data: str = "self"  # self-distillation: drafts are judged against the model's outputs, not the text's
    draft_vocab_size: int = 0  # > 0: drafting scores only the most frequent tokens of the training labels
    eval_every: int = 50  # > 0: evaluate every N steps, keep the heads of the best held-out score (0: the last)
    seed: int = 0

    def check(self) -> None:
        if self.data not in DATA_SOURCES:
            raise ValueError(f"data must be one of {DATA_SOURCES}, got {self.data!r}")
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
        if self.draft_vocab_size < 0 or (self.draft_vocab_size and not self.share_lm_head):
            raise ValueError(f"draft_vocab_size must be >= 0 and needs a shared LM head, got {self.draft_vocab_size}")


# ---------------------------------------------------------------------- data
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


# ---------------------------------------------------------------------- training
def head_targets(token_ids: torch.Tensor, num_heads: int,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Usable positions and their labels: [N, T] -> (positions [M] flat index into N*T, labels [M, K]);
    head k of position t is labelled token t + k + 2 (positions whose labels pass the end are dropped).
    `positions`: the usable flat positions, given (ragged sequences laid end to end, `ragged_positions`)."""
    if positions is not None:
        flat_ids = token_ids.reshape(-1)
        return positions, torch.stack([flat_ids[positions + k + 2] for k in range(num_heads)], dim=-1)
    n, t = token_ids.shape
    last = t - num_heads - 1  # position t needs tokens up to t + num_heads + 1
    pos = torch.arange(last)
    labels = torch.stack([token_ids[:, pos + k + 2] for k in range(num_heads)], dim=-1)  # [N, last, K]
    flat = (torch.arange(n)[:, None] * t + pos[None, :]).reshape(-1)
    return flat, labels.reshape(-1, num_heads)


def ragged_positions(lengths: list[int], starts: list[int], num_heads: int) -> torch.Tensor:
    """Sequences laid end to end: the flat positions t of each (length L, first trained position s) with
    s <= t and t + num_heads + 1 < L, so no label crosses into the next sequence."""
    out, offset = [], 0
    for length, start in zip(lengths, starts):
        first, end = max(0, start), length - num_heads - 1
        out.append(torch.arange(first, max(first, end)) + offset)
        offset += length
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def medusa_loss(logits: torch.Tensor, labels: torch.Tensor, decay: float = MEDUSA_DECAY) -> torch.Tensor:
    """logits [M, K, V], labels [M, K] -> sum_k decay^k * mean CE of head k (labels -100: not counted)."""
    k = logits.shape[1]
    return sum(decay**i * F.cross_entropy(logits[:, i].float(), labels[:, i], ignore_index=-100) for i in range(k))


def label_indices(labels: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Token-id labels -> indices into an LM head that scores only `vocab` (None: the whole vocabulary, as is);
    a label outside it becomes -100 (no loss: a draft vocabulary can never draft it)."""
    if vocab is None:
        return labels
    index_of = torch.full((vocab_size,), -100, dtype=torch.long)
    index_of[vocab] = torch.arange(vocab.numel())
    return index_of[labels]


@torch.no_grad()
def head_predictions(heads: MedusaHeads, lm_head: Callable, hidden: torch.Tensor,
                     vocab: torch.Tensor | None = None) -> torch.Tensor:
    """[M, H] hidden states -> [M, K] each head's top-1 token id, as the proposer drafts it: `lm_head` scores
    `vocab` (None: every token) and its indices map back to token ids."""
    top = heads(hidden, lm_head).argmax(-1)
    return top if vocab is None else vocab[top]


@torch.no_grad()
def evaluate(heads: MedusaHeads, lm_head: Callable, hidden: torch.Tensor, token_ids: torch.Tensor,
             positions: torch.Tensor | None = None, vocab: torch.Tensor | None = None,
             base_lm_head: Callable | None = None) -> dict[str, float]:
    """Top-1 accuracy per head (and the base LM head's next-token accuracy) on every usable position.
    `lm_head` scores `vocab` (see head_predictions): pass the serving LM head and the serving dtype's hidden
    states and these are the heads' served draft rates (a label outside `vocab` counts as a miss).
    `base_lm_head`: the target's full LM head (default lm_head)."""
    flat, labels = head_targets(token_ids, heads.num_heads, positions)
    h = hidden.reshape(-1, hidden.shape[-1])[flat]
    base_lm_head = base_lm_head or lm_head
    correct = torch.zeros(heads.num_heads)
    base_correct = 0
    for i in range(0, len(flat), 512):
        correct += (head_predictions(heads, lm_head, h[i : i + 512], vocab) == labels[i : i + 512]).sum(0).float()
        next_tok = token_ids.reshape(-1)[flat[i : i + 512] + 1]
        base_correct += int((base_lm_head(h[i : i + 512]).argmax(-1) == next_tok).sum())
    acc = {f"head{k + 1}": float(c) / max(1, len(flat)) for k, c in enumerate(correct)}
    return {"base": base_correct / max(1, len(flat)), **acc}


def heads_score(acc: dict[str, float]) -> float:
    """Expected drafts accepted per chain step if the heads erred independently: acc1 + acc1*acc2 + ... (the
    held-out score the trainer keeps the best heads by)."""
    score, run, k = 0.0, 1.0, 1
    while f"head{k}" in acc:
        run *= acc[f"head{k}"]
        score += run
        k += 1
    return score


def train_heads(heads: MedusaHeads, lm_head: Callable, hidden: torch.Tensor, token_ids: torch.Tensor,
                config: MedusaTrainConfig, progress: Callable[[str], None] | None = None,
                positions: torch.Tensor | None = None, vocab: torch.Tensor | None = None,
                evaluate_fn: Callable[[], dict[str, float]] | None = None) -> list[float]:
    """AdamW on the heads only, `config.steps` batches of random usable positions. hidden [N, T, H] fp32
    (precomputed), token_ids [N, T] (`positions`: see head_targets). `lm_head` scores `vocab` (None: the whole
    vocabulary; see label_indices). `evaluate_fn` (held-out accuracies, see evaluate): called every
    config.eval_every steps and at the end; the heads keep the weights of its best heads_score (a few hundred
    steps over a few hundred answers overfit: train top-1 0.6 while held-out peaks and falls).
    Returns the loss of every step."""
    flat, labels = head_targets(token_ids, heads.num_heads, positions)
    labels = label_indices(labels, vocab, heads.vocab_size)
    h_all = hidden.reshape(-1, hidden.shape[-1])
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, config.warmup_steps)))
    gen = torch.Generator().manual_seed(config.seed)
    losses, best = [], (float("-inf"), None, 0)
    for step in range(config.steps):
        heads.train()
        pick = torch.randint(len(flat), (min(config.batch_size, len(flat)),), generator=gen)
        loss = medusa_loss(heads(h_all[flat[pick]], lm_head), labels[pick])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress and (step % 50 == 0 or step == config.steps - 1):
            progress(f"step {step + 1}/{config.steps} loss {losses[-1]:.3f}")
        if evaluate_fn and config.eval_every and ((step + 1) % config.eval_every == 0 or step == config.steps - 1):
            heads.eval()
            score = heads_score(evaluate_fn())
            if score > best[0]:
                best = (score, {k: v.detach().clone() for k, v in heads.state_dict().items()}, step + 1)
            if progress:
                progress(f"step {step + 1}: held-out score {score:.3f} (best {best[0]:.3f} at step {best[2]})")
    if best[1] is not None:
        heads.load_state_dict(best[1])
        heads.training_info["best_step"] = best[2]
    heads.eval()
    return losses


def frequent_tokens(labels: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` token ids that occur most often among the labels (ties: the lower id)."""
    counts = torch.bincount(labels.reshape(-1), minlength=size)
    return torch.sort(counts, descending=True, stable=True).indices[:size]


def vocab_coverage(labels: torch.Tensor, vocab: torch.Tensor) -> float:
    """Share of the labels inside `vocab` (the best a head restricted to it can do)."""
    return float(torch.isin(labels.reshape(-1), vocab).float().mean()) if labels.numel() else 0.0


def load_base(model: str | None):
    """(ModelFiles, HF float32 CausalLM with frozen weights) of an HF dir / .gguf / None (default model)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from pagellm.model_loader import open_model  # noqa: PLC0415

    files = open_model(model)
    if files.tokenizer is None:
        raise ValueError(f"{files.path}: no tokenizer files; training text needs the model's tokenizer")
    base = AutoModelForCausalLM.from_pretrained(str(files.path), dtype=torch.float32).eval()
    base.requires_grad_(False)
    return files, base


def frozen_lm_head(base) -> Callable[[torch.Tensor], torch.Tensor]:
    weight = base.get_output_embeddings().weight.detach().float()
    return lambda x: F.linear(x, weight)


AnswerFn = Callable[[list[list[int]], int], list[list[int]]]  # (prompts, answer_len) -> prompt + answer each


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


def train_medusa(output: str | Path, model: str | None = None, config: MedusaTrainConfig | None = None,
                 progress: Callable[[str], None] | None = None,
                 answer_fn: AnswerFn | None = None,
                 data_cache: str | Path | None = None) -> tuple[Path, dict[str, float]]:
    """The whole recipe (module doc); writes the heads to `output`. Returns it and the held-out accuracies
    (the served way: draft vocabulary, bf16 hidden states and LM-head rows). `answer_fn`: see
    chat_training_data (`--data chat` only). `data_cache`: a directory keeping the token ids and hidden states
    (per model and data settings), so that another run with other training settings skips the answers."""
    config = config or MedusaTrainConfig()
    config.check()
    say = progress or (lambda _msg: None)
    torch.manual_seed(config.seed)
    t0 = time.perf_counter()
    files, base = load_base(model)
    hf = files.hf_config
    data = _cached_data(data_cache, model, config,
                        lambda: {held_out: _training_data(base, files.tokenizer, config, held_out, say, answer_fn)
                                 for held_out in (False, True)})
    say(f"hidden states of {data[False][0].numel()} train / {data[True][0].numel()} held-out tokens "
        f"in {time.perf_counter() - t0:.0f}s")
    heads = MedusaHeads(int(hf.hidden_size), int(hf.vocab_size), config.num_heads, config.num_layers,
                        config.share_lm_head, base_model=str(files.source), base_model_hash=base_model_hash(hf))
    weight = base.get_output_embeddings().weight.detach().float()
    if not config.share_lm_head:
        heads.init_lm_heads_from(weight)
    (train_ids, train_hidden, train_pos), (eval_ids, eval_hidden, eval_pos) = data[False], data[True]
    train_hidden = train_hidden.to(torch.bfloat16).float()  # what the engine hands the heads: bf16 states
    vocab = None
    if config.draft_vocab_size:  # chosen first: the heads train over the rows the proposer will score
        vocab = frequent_tokens(head_targets(train_ids, config.num_heads, train_pos)[1],
                                min(config.draft_vocab_size, int(hf.vocab_size)))
        heads.set_draft_vocab(vocab)
        vocab = heads.draft_vocab
    train_lm_head = (lambda x: F.linear(x, weight[vocab])) if vocab is not None else frozen_lm_head(base)
    served = served_evaluation(heads, weight, eval_hidden, eval_ids, eval_pos)
    before = served()
    losses = train_heads(heads, train_lm_head, train_hidden, train_ids, config, progress=say, positions=train_pos,
                         vocab=vocab, evaluate_fn=served)
    acc = served()
    if vocab is not None:
        acc["draft_vocab_coverage"] = vocab_coverage(head_targets(eval_ids, config.num_heads, eval_pos)[1], vocab)
    heads.training_info = {**asdict(config), "final_loss": losses[-1], "held_out_top1": acc,
                           "held_out_top1_untrained": before, "best_step": heads.training_info.get("best_step"),
                           "seconds": round(time.perf_counter() - t0, 1)}
    say("held-out top-1 (served way): " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()))
    return heads.save(output), acc


def _training_data(base, tokenizer, config: MedusaTrainConfig, held_out: bool, say: Callable[[str], None],
                   answer_fn: AnswerFn | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(token ids, hidden states, trained positions or None) of the training or held-out set."""
    if config.data == "chat":
        return chat_training_data(base, tokenizer, config, held_out, say, answer_fn)
    ids = torch.tensor(build_windows(tokenizer, config, held_out), dtype=torch.long)
    if config.data == "self":
        say(f"self-distillation: continuing {len(ids)} prompts to {config.seq_len} tokens")
        ids = greedy_continuations(base, ids, config.seq_len)
    return ids, final_hidden_states(base, ids), None


def _cached_data(cache: str | Path | None, model: str | None, config: MedusaTrainConfig, compute: Callable) -> dict:
    """compute() once per (model, data settings) when a cache directory is given."""
    if cache is None:
        return compute()
    keys = ("data", "seq_len", "num_train_seqs", "num_eval_seqs", "num_heads", "seed")
    key = hashlib.sha256(json.dumps([str(model), *(getattr(config, k) for k in keys)]).encode()).hexdigest()[:16]
    path = Path(cache).expanduser() / f"medusa-data-{key}.pt"
    if path.is_file():
        return torch.load(path)
    data = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)
    return data


def served_lm_head(heads: MedusaHeads, lm_weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The LM head the proposer drafts with: a draft vocabulary's bf16 rows (draft_vocab_lm_head), else fp32."""
    if heads.draft_vocab is not None:
        return draft_vocab_lm_head(lm_weight, heads.draft_vocab)
    return lambda x: F.linear(x, lm_weight)


def served_evaluation(heads: MedusaHeads, lm_weight: torch.Tensor, hidden: torch.Tensor, token_ids: torch.Tensor,
                      positions: torch.Tensor | None) -> Callable[[], dict[str, float]]:
    """() -> held-out accuracies computed as the engine drafts: hidden states rounded to bf16 (the engine serves
    in bf16), the proposer's LM head (served_lm_head) mapped back to token ids, the heads in fp32."""
    hidden = hidden.to(torch.bfloat16).float()
    lm_head, full = served_lm_head(heads, lm_weight), (lambda x: F.linear(x, lm_weight))
    return lambda: evaluate(heads, lm_head, hidden, token_ids, positions, vocab=heads.draft_vocab, base_lm_head=full)
