"""Training Medusa heads (medusa_heads.py) on a frozen base model: `pagellm train-medusa`.

    pagellm train-medusa --output /tmp/smollm2-medusa                # default model, self-distillation
    pagellm train-medusa --output DIR --model ./my-llama --data kjv --num-heads 4 --steps 600

1. Data (medusa_train_data.py; token windows of seq_len): `kjv` / `pydoc` are the machine's own texts
   (quantization/calibration_data.py: Debian bible-kjv, python3.11-doc); `self` is self-distillation
   (Medusa-2): the base model's own greedy continuations of KJV prompts, so the heads learn what the model
   will say; `chat` is self-distillation on chat turns (medusa_chat_data.py): user questions through the
   model's chat template and the model's own greedy answer (to its first EOS, at most seq_len tokens); only
   the answer's positions train. Held out for evaluation: Ecclesiastes / the held-out doc page (their
   continuations for `self`), questions on unseen topics for `chat`.
2. The frozen base (HF transformers, float32) computes every window's final normed hidden states once
   (`model.model(...).last_hidden_state`: what pagellm's ModelRunner returns for the same weights); they are
   rounded to bf16, as the engine serving in bf16 hands them to the proposer.
3. Only the heads train: position t's hidden state h_t; head k (0-based) predicts token t + k + 2 (the
   base's LM head predicts t + 1); loss = sum_k decay^k * CE(head_k(h_t), token_{t+k+2}) (Medusa's
   decay 0.8), AdamW over random batches of positions, linear warm-up. With a draft vocabulary
   (`--draft-vocab-size`) the vocabulary is chosen first and the CE runs over its LM-head rows only, the
   rows the proposer will score (a sixth of the LM head's cost per step for 8192 of SmolLM2's 49152).
Evaluation (held-out per-head top-1, the base LM head's too) is computed the served way: bf16 hidden states,
the proposer's LM head (the draft vocabulary's bf16 rows), draft indices mapped back to token ids; and the
answers are walked as the engine walks them with chains of K drafts (chain_walk): `chain_head1`, the first
draft's acceptance per step, and `chain_accepted_len`, the benchmark's mean accepted length when every step
drafts. Every `eval_every` steps the heads are evaluated and the best (heads_score) are kept.

Served acceptance vs these accuracies (issue 17, session 13). tests/engine/test_medusa_train_serve_agreement.py
locks that the engine drafts exactly the trainer's teacher-forced predictions (same hidden state, label offset
t + k + 2, draft ids mapped back), counts acceptance as the prefix the text confirms, and that chain_walk on the
engine's answers gives the engine's per-step rates. The gap between "held-out top-1 0.27" and "acceptance 0.04,
mean accepted length 1.12" is not a train/serve mismatch: (1) per-position top-1 is not a per-step rate: an
accepted run skips the easy positions after it (session 12's heads, held out: head-1 top-1 0.278, chain_head1
0.238, chain_accepted_len 1.32; served on 8 of those questions, every step drafting: head 1 right 0.22 of steps,
length 1.29); (2) the benchmark's `acceptance` is accepted / drafted over k = 3 drafts (1.29 -> 0.10); (3) its
chat questions are further from the training templates (served head 1: 0.17 of steps, length 1.24); (4) the
adaptive switch measures only the steps it lets draft. bf16 hidden states and the draft vocabulary cost nothing
measurable (served-way held-out top-1 0.278 / 0.156 / 0.109 vs the fp32 full-vocabulary 0.273 / 0.150 / 0.107).
Session 13's retrain (384 answers, CE over the draft vocabulary, best of 1000 steps at step 800) reached the same
held-out accuracy (0.274 / 0.155 / 0.119, chain_accepted_len 1.30): more of these answers does not make these
one-ResBlock heads better; the ceiling is the heads, not the data plumbing.
Session 14: `--head-type hydra` (hydra_heads.py: each head also reads the token before its guess; trained
teacher-forced on the text's tokens, evaluated drafting sequentially as served) on the same cached answers,
`--lr 3e-3 --batch-size 256 --weight-decay 0.1`, best at step 450: held-out 0.385 / 0.225 / 0.139, chain_head1 0.327,
chain_accepted_len 1.51 (Medusa heads on the same data: 1.30).
Session 15: `--data distill` (medusa_prompts.py, medusa_distill.py): 2400 varied prompts answered by pagellm in bf16
(1800 greedy, 600 sampled, 263k trained positions, states recorded as served), Hydra heads with the same settings,
1000 steps, kept by the held-out served chain length (`selection_score`; 1.485 at step 1000, still rising slowly);
held-out (160 prompts on unseen topics / passages / modules) top-1 0.374 / 0.189 / 0.112, chain 1.49, fitted 4-node
tree 1.63, 12-node 1.82 (`fitted_trees`).

Earlier sessions (kjv / self data; benchmarks/README.md): text labels teach the heads the text, not the model, so
self-distillation is the default; the engine's drafts equal the heads' top-1 on the trainer's states
(tests/engine/test_spec_medusa.py). Session 19: the trainer's walk on the chat benchmark's own answers equals the
served accepted length (benchmarks/bench_medusa_walk.py): held-out vs served differ by the prompts; `--kl-weight`
(KL against the target's distribution) trains like CE; the heads score 2.05 on their training answers vs 1.59 held out.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from torch.nn import functional as F

from pagellm.spec_decode.hydra_heads import HEAD_TYPES, HydraHeads, load_draft_heads
from pagellm.spec_decode.medusa_heads import MedusaHeads, base_model_hash, draft_vocab_lm_head
from pagellm.spec_decode.medusa_tree_fit import fit_trees
from pagellm.spec_decode.medusa_train_data import (AnswerFn, MedusaTrainConfig, RecordFn, cached_training_data,
                                                   sharded_training_data, training_data)

MEDUSA_DECAY = 0.8  # Medusa's medusa_decay_coefficient: later heads weigh less


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


def head_inputs(token_ids: torch.Tensor, flat: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[M, K] the token before each head's guess at flat positions t: x_{t+1} .. x_{t+K} (what Hydra heads read;
    teacher forcing: the text's tokens, the case in which a chain's draft k is judged)."""
    flat_ids = token_ids.reshape(-1)
    return torch.stack([flat_ids[flat + k + 1] for k in range(num_heads)], dim=-1)


def medusa_loss(logits: torch.Tensor, labels: torch.Tensor, decay: float = MEDUSA_DECAY,
                target_logits: torch.Tensor | None = None, kl_weight: float = 0.0) -> torch.Tensor:
    """logits [M, K, V], labels [M, K] -> sum_k decay^k * mean CE of head k (labels -100: not counted).
    `target_logits` [M, K, V]: the target's own logits where head k's guess is judged (its whole distribution over
    the same rows, not only its argmax); with them head k's term is (1 - kl_weight) * CE + kl_weight *
    KL(target || head), the batch mean."""
    total = logits.new_zeros(())
    for i in range(logits.shape[1]):
        head = logits[:, i].float()
        term = F.cross_entropy(head, labels[:, i], ignore_index=-100) if kl_weight < 1 else 0.0
        if kl_weight > 0:
            kl = F.kl_div(F.log_softmax(head, -1), F.log_softmax(target_logits[:, i].float(), -1), log_target=True,
                          reduction="batchmean")
            term = (1 - kl_weight) * term + kl_weight * kl
        total = total + decay**i * term
    return total


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
                     vocab: torch.Tensor | None = None, last_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[M, H] hidden states -> [M, K] each head's top-1 token id, as the proposer drafts it: `lm_head` scores
    `vocab` (None: every token) and its indices map back to token ids; `last_ids` [M], the token each hidden
    state gave (Hydra heads draft from it, each head fed the previous head's draft)."""
    return heads.draft_chain(hidden, last_ids, lm_head, to_token_ids=None if vocab is None else (lambda i: vocab[i]))


@torch.no_grad()
def evaluate(heads: MedusaHeads, lm_head: Callable, hidden: torch.Tensor, token_ids: torch.Tensor,
             positions: torch.Tensor | None = None, vocab: torch.Tensor | None = None,
             base_lm_head: Callable | None = None) -> dict[str, float]:
    """Top-1 accuracy per head (and the base LM head's next-token accuracy) on every usable position.
    `lm_head` scores `vocab` (see head_predictions): pass the serving LM head and the serving dtype's hidden
    states and these are the heads' served draft rates (a label outside `vocab` counts as a miss).
    `base_lm_head`: the target's full LM head (default lm_head; False: the base's accuracy is not computed, a
    [positions, vocabulary] product that does not change while the heads train)."""
    flat, labels = head_targets(token_ids, heads.num_heads, positions)
    h = hidden.reshape(-1, hidden.shape[-1])[flat]
    base_lm_head = lm_head if base_lm_head is None else base_lm_head
    hits, base_correct = [], 0
    for i in range(0, len(flat), 512):
        next_tok = token_ids.reshape(-1)[flat[i : i + 512] + 1]
        hits.append(head_predictions(heads, lm_head, h[i : i + 512].float(), vocab, next_tok) == labels[i : i + 512])
        if base_lm_head is not False:
            base_correct += int((base_lm_head(h[i : i + 512].float()).argmax(-1) == next_tok).sum())
    hits_all = torch.cat(hits) if hits else torch.zeros(0, heads.num_heads, dtype=torch.bool)
    acc = {f"head{k + 1}": float(c) / max(1, len(flat)) for k, c in enumerate(hits_all.sum(0).float())}
    base = {} if base_lm_head is False else {"base": base_correct / max(1, len(flat))}
    return {**base, **acc, **chain_walk(flat, hits_all)}


def chain_walk(flat: torch.Tensor, hits: torch.Tensor) -> dict[str, float]:
    """What the engine sees drafting chains of K along these texts (greedy, every step drafting): from each
    turn's first position t it accepts the longest run of correct heads a and moves to t + 1 + a, so accepted
    runs skip the easy positions and the per-step rates are below the per-position accuracies. flat [M] sorted
    positions (a gap: another turn), hits [M, K] head k right at that position. Returns the first draft's
    acceptance per step (`chain_head1`) and the benchmark's mean accepted length (`chain_accepted_len`: 1 +
    accepted drafts per step)."""
    runs = torch.cumprod(hits.long(), dim=1).sum(1).tolist()  # accepted drafts if the engine stood at each position
    starts = [0] + (torch.nonzero(flat[1:] - flat[:-1] > 1).flatten() + 1).tolist() if len(flat) else []
    steps = accepted = first = 0
    for s, e in zip(starts, starts[1:] + [len(runs)]):  # one turn: positions flat[s] .. flat[e - 1], consecutive
        i = s
        while i < e:
            steps, accepted, first = steps + 1, accepted + runs[i], first + (runs[i] > 0)
            i += 1 + runs[i]
    return {"chain_head1": first / max(1, steps), "chain_accepted_len": 1 + accepted / max(1, steps)}


def selection_score(acc: dict[str, float]) -> float:
    """What the trainer keeps the best heads by: the held-out mean accepted length of a served chain
    (`chain_accepted_len`, chain_walk: the benchmark's measure) when evaluated, else heads_score."""
    return acc["chain_accepted_len"] if "chain_accepted_len" in acc else heads_score(acc)


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
                evaluate_fn: Callable[[], dict[str, float]] | None = None,
                label_ids: torch.Tensor | None = None) -> list[float]:
    """AdamW on the heads only, `config.steps` batches of random usable positions. hidden [N, T, H] (precomputed;
    fp32 or bf16, each batch widened to fp32), token_ids [N, T] (`positions`: see head_targets). `label_ids`
    [N, T]: the token the target would choose at each position (default token_ids; a sampled answer's differ,
    medusa_distill.greedy_labels): head k of position t learns label_ids[t + k + 2] reading token_ids. `lm_head`
    scores `vocab` (None: the whole vocabulary; see label_indices). `evaluate_fn` (held-out accuracies, see
    evaluate): called every config.eval_every steps and at the end; the heads keep the weights of its best
    selection_score (a few hundred steps over a few hundred answers overfit: train top-1 0.6 while held-out
    peaks and falls). Returns the loss of every step."""
    flat, labels = head_targets(token_ids if label_ids is None else label_ids, heads.num_heads, positions)
    labels = label_indices(labels, vocab, heads.vocab_size)
    inputs = head_inputs(token_ids, flat, heads.num_heads)
    h_all = hidden.reshape(-1, hidden.shape[-1])
    # config.kl_weight: head k at t is also judged against the target's distribution at t + k + 1, the logits of the
    # state that chose its label (the same LM-head rows; a sampled answer's state gives its greedy label's too)
    target_rows = flat[:, None] + torch.arange(heads.num_heads)[None, :] + 1 if config.kl_weight > 0 else None
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, config))
    gen = torch.Generator().manual_seed(config.seed)
    losses, best = [], (float("-inf"), None, 0)
    for step in range(config.steps):
        heads.train()
        pick = torch.randint(len(flat), (min(config.batch_size, len(flat)),), generator=gen)
        target = None
        if target_rows is not None:
            with torch.no_grad():
                target = lm_head(h_all[target_rows[pick]].float())
        loss = medusa_loss(heads.teacher_forced(h_all[flat[pick]].float(), inputs[pick], lm_head), labels[pick],
                           target_logits=target, kl_weight=config.kl_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress and (step % 50 == 0 or step == config.steps - 1):
            progress(f"step {step + 1}/{config.steps} loss {losses[-1]:.3f}")
        if evaluate_fn and config.eval_every and ((step + 1) % config.eval_every == 0 or step == config.steps - 1):
            heads.eval()
            score = selection_score(evaluate_fn())
            if score > best[0]:
                best = (score, {k: v.detach().clone() for k, v in heads.state_dict().items()}, step + 1)
            if progress:
                progress(f"step {step + 1}: held-out score {score:.3f} (best {best[0]:.3f} at step {best[2]})")
    if best[1] is not None:
        heads.load_state_dict(best[1])
        heads.training_info["best_step"] = best[2]
    heads.eval()
    return losses


LR_FLOOR = 0.05  # a cosine schedule ends at this fraction of lr


def lr_factor(step: int, config: MedusaTrainConfig) -> float:
    """The learning rate of `step` (0-based) over config.lr: a linear warm-up, then 1 ("constant") or a half
    cosine from 1 down to LR_FLOOR at the last step ("cosine")."""
    warm = max(1, config.warmup_steps)
    if step < warm:
        return (step + 1) / warm
    if config.lr_schedule == "constant":
        return 1.0
    done = min(1.0, (step - warm + 1) / max(1, config.steps - warm))
    return LR_FLOOR + (1.0 - LR_FLOOR) * 0.5 * (1.0 + math.cos(math.pi * done))


def init_heads_from(heads: MedusaHeads, directory: str) -> None:
    """Start a training from stored heads (continue one): ValueError unless they are of the same kind, sizes and
    draft vocabulary as `heads` (whose draft vocabulary is already chosen)."""
    src = load_draft_heads(directory, dtype=torch.float32)
    mine = (type(heads).__name__, heads.hidden_size, heads.vocab_size, heads.num_heads, heads.num_layers)
    theirs = (type(src).__name__, src.hidden_size, src.vocab_size, src.num_heads, src.num_layers)
    if mine != theirs:
        raise ValueError(f"init_from {directory!r}: heads (kind, hidden, vocab, heads, layers) {theirs}, "
                         f"this training's {mine}")
    same_vocab = (src.draft_vocab is None and heads.draft_vocab is None) or (
        src.draft_vocab is not None and heads.draft_vocab is not None and torch.equal(src.draft_vocab, heads.draft_vocab))
    if not same_vocab:
        raise ValueError(f"init_from {directory!r}: another draft vocabulary than this training's data gives")
    heads.load_state_dict(src.state_dict())


def stored_draft_vocab(directory: str, size: int) -> torch.Tensor | None:
    """The draft vocabulary of stored heads if it has `size` tokens, else None."""
    vocab = load_draft_heads(directory, dtype=torch.float32).draft_vocab
    return vocab if vocab is not None and vocab.numel() == size else None


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


def train_medusa(output: str | Path, model: str | None = None, config: MedusaTrainConfig | None = None,
                 progress: Callable[[str], None] | None = None,
                 answer_fn: AnswerFn | None = None,
                 data_cache: str | Path | list | None = None,
                 record_fn: RecordFn | None = None, answer_shards: str | None = None,
                 data_only: bool = False) -> tuple[Path | None, dict[str, float]]:
    """The whole recipe (module doc); writes the heads to `output`. Returns it and the held-out accuracies
    (the served way: draft vocabulary, bf16 hidden states and LM-head rows). `answer_fn`: see
    chat_training_data (`--data chat` only); `record_fn`: see distill_training_data (`--data distill` only).
    `data_cache`: a directory keeping the token ids and hidden states
    (per model and data settings), so that another run with other training settings skips the answers; with
    `config.shard_size` a list of directories (medusa_data_shards.py): `answer_shards` (parse_shards' spec) are
    answered into the first where none holds them, and training reads every shard found in any; `data_only`: stop
    after answering (returns (None, {}))."""
    config = config or MedusaTrainConfig()
    config.check()
    say = progress or (lambda _msg: None)
    torch.manual_seed(config.seed)
    t0 = time.perf_counter()
    if data_only:  # answering needs the tokenizer, not the HF float32 model
        from pagellm.model_loader import open_model  # noqa: PLC0415

        files, base = open_model(model), None
    else:
        files, base = load_base(model)
    hf = files.hf_config
    caches = list(data_cache) if isinstance(data_cache, (list, tuple)) else [data_cache] if data_cache else []
    if config.shard_size:
        data = sharded_training_data(caches, model, config, files.tokenizer, say, record_fn, answer_shards,
                                     load=not data_only)
        if data_only:
            return None, {}
    else:
        if len(caches) > 1:
            raise ValueError("several data caches need answers in shards (shard_size > 0)")
        data = cached_training_data(caches[0] if caches else None, model, config,
                                    lambda: {held_out: training_data(base, files.tokenizer, config, held_out, say,
                                                                     answer_fn, record_fn)
                                             for held_out in (True, False)})  # the short held-out set first
    say(f"hidden states of {data[False][0].numel()} train / {data[True][0].numel()} held-out tokens "
        f"in {time.perf_counter() - t0:.0f}s")
    heads = HEAD_TYPES[config.head_type](int(hf.hidden_size), int(hf.vocab_size), config.num_heads, config.num_layers,
                                         config.share_lm_head, base_model=str(files.source),
                                         base_model_hash=base_model_hash(hf))
    if isinstance(heads, HydraHeads):
        heads.set_embedding(base.get_input_embeddings().weight)
    weight = base.get_output_embeddings().weight.detach().float()
    if not config.share_lm_head:
        heads.init_lm_heads_from(weight)
    (train_ids, train_hidden, train_pos, *train_labels), (eval_ids, eval_hidden, eval_pos, *_) = data[False], data[True]
    train_labels = train_labels[0] if train_labels else None  # --data distill: the target's greedy tokens
    train_hidden = train_hidden.to(torch.bfloat16)  # what the engine hands the heads: bf16 states
    vocab = None
    if config.draft_vocab_size:  # chosen first: the heads train over the rows the proposer will score
        size = min(config.draft_vocab_size, int(hf.vocab_size))
        vocab = stored_draft_vocab(config.init_from, size) if config.init_from else None
        if vocab is None:  # continuing keeps the stored heads' rows: more data may rank a few tokens otherwise
            vocab = frequent_tokens(head_targets(train_ids if train_labels is None else train_labels,
                                                 config.num_heads, train_pos)[1], size)
        heads.set_draft_vocab(vocab)
        vocab = heads.draft_vocab
    if config.init_from:
        init_heads_from(heads, config.init_from)
    train_lm_head = (lambda x: F.linear(x, weight[vocab])) if vocab is not None else frozen_lm_head(base)
    served = served_evaluation(heads, weight, eval_hidden, eval_ids, eval_pos)
    before = served()
    losses = train_heads(heads, train_lm_head, train_hidden, train_ids, config, progress=say, positions=train_pos,
                         vocab=vocab, evaluate_fn=served, label_ids=train_labels)
    acc = served()
    trees = fitted_trees(heads, weight, eval_hidden, eval_ids, eval_pos, config.tree_row_cost)
    say("fitted trees (held-out served accepted length): " + ", ".join(
        f"{n}: {t['accepted_len']:.3f}" for n, t in trees.items() if n != "served") + f"; served: {trees['served']}")
    if vocab is not None:
        acc["draft_vocab_coverage"] = vocab_coverage(head_targets(eval_ids, config.num_heads, eval_pos)[1], vocab)
    heads.training_info = {**asdict(config), "final_loss": losses[-1], "held_out_top1": acc,
                           "held_out_top1_untrained": before, "best_step": heads.training_info.get("best_step"),
                           "trees": trees,
                           "seconds": round(time.perf_counter() - t0, 1)}
    say("held-out top-1 (served way): " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()))
    return heads.save(output), acc


def served_lm_head(heads: MedusaHeads, lm_weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The LM head the proposer drafts with: a draft vocabulary's bf16 rows (draft_vocab_lm_head), else fp32."""
    if heads.draft_vocab is not None:
        return draft_vocab_lm_head(lm_weight, heads.draft_vocab)
    return lambda x: F.linear(x, lm_weight)


def fitted_trees(heads: MedusaHeads, lm_weight: torch.Tensor, hidden: torch.Tensor, token_ids: torch.Tensor,
                 positions: torch.Tensor | None, row_cost: float, max_positions: int = 6000) -> dict:
    """medusa_tree_fit.fit_trees on (at most max_positions of) the held-out positions, the served way, plus
    "served": the size whose accepted length per verify cost (1 + row_cost per node) is best: `"tree": "heads"`."""
    flat, _ = head_targets(token_ids, heads.num_heads, positions)
    if len(flat) > max_positions:  # whole answers first: the walk needs consecutive positions
        flat = flat[:max_positions]
    vocab = heads.draft_vocab
    trees = fit_trees(heads, served_lm_head(heads, lm_weight), hidden.to(torch.bfloat16), token_ids, flat,
                      None if vocab is None else (lambda i: vocab[i]))
    sizes = [n for n in trees if n != "chain"]
    trees["served"] = max(sizes, key=lambda n: trees[n]["accepted_len"] / (1 + row_cost * int(n)))
    return trees


def served_evaluation(heads: MedusaHeads, lm_weight: torch.Tensor, hidden: torch.Tensor, token_ids: torch.Tensor,
                      positions: torch.Tensor | None) -> Callable[[], dict[str, float]]:
    """() -> held-out accuracies computed as the engine drafts: hidden states rounded to bf16 (the engine serves
    in bf16), the proposer's LM head (served_lm_head) mapped back to token ids, the heads in fp32."""
    hidden = hidden.to(torch.bfloat16)  # widened per chunk (evaluate): a held-out set of distilled answers is large
    lm_head, full = served_lm_head(heads, lm_weight), (lambda x: F.linear(x, lm_weight))
    base: dict[str, float] = {}

    def run() -> dict[str, float]:
        acc = evaluate(heads, lm_head, hidden, token_ids, positions, vocab=heads.draft_vocab,
                       base_lm_head=False if base else full)
        base.setdefault("base", acc.pop("base", None))
        return {"base": base["base"], **acc}

    return run
