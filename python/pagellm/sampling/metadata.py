"""Per-step sampling metadata: one row per logits row, batched into tensors once per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from pagellm.sampling_params import SamplingParams, resolve_logprobs_mode


@dataclass
class SamplingRow:
    """What the sampler needs about one logits row (one sequence about to emit a token)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None  # set for seeded requests


@dataclass
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None  # float32 [N]; greedy rows hold 1.0 (never divided); None: plain_greedy_metadata
    greedy_mask: torch.Tensor | None  # bool [N]; None: plain_greedy_metadata
    top_k: torch.Tensor | None  # int64 [N], vocab_size where off
    top_p: torch.Tensor | None  # float32 [N]
    min_p: torch.Tensor | None  # float32 [N]
    # seeded rows: row index -> generator
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # penalties (None when no row uses any)
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None  # int64 [N, Lp] padded with vocab_size
    output_token_ids: torch.Tensor | None = None  # int64 [N, Lo] padded with vocab_size
    # logit bias as flat (row, token, bias)
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # min_tokens: (row, token) pairs to mask with -inf
    min_tok_rows: torch.Tensor | None = None
    min_tok_tokens: torch.Tensor | None = None
    # logprobs
    max_num_logprobs: int | None = None  # max over rows requesting logprobs
    processed_logprobs_rows: torch.Tensor | None = None  # bool [N]: rows in a processed_* logprobs_mode
    any_processed: bool = False
    logits_rows: torch.Tensor | None = None  # bool [N]: rows in a *_logits logprobs_mode
    any_logits: bool = False


def is_plain_greedy(p: SamplingParams) -> bool:
    """Whether a request's every token is the argmax of the raw logits and the sampler owes it nothing else: greedy,
    no logprobs, no logit bias, no min_tokens mask, no penalties (build_sampling_metadata would set none of them)."""
    return (p.temperature == 0.0 and p.logprobs is None and not p.logit_bias and not p.min_tokens
            and p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1.0)


def plain_greedy_metadata(num_rows: int, vocab_size: int) -> SamplingMetadata:
    """Metadata of rows that are all plain greedy (`is_plain_greedy`): the Sampler takes its argmax path, which reads
    nothing per row, so no tensors are built (the engine's per-step fast path)."""
    return SamplingMetadata(num_rows=num_rows, vocab_size=vocab_size, all_greedy=True, all_random=False,
                            temperature=None, greedy_mask=None, top_k=None, top_p=None, min_p=None)


def _pad(rows: list[Sequence[int]], pad: int, device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out.to(device)


def build_sampling_metadata(rows: list[SamplingRow], vocab_size: int, device: torch.device | str = "cpu") -> SamplingMetadata:
    """Batch per-row parameters into tensors (per-request loops only; the math is batched)."""
    n = len(rows)
    ps = [r.params for r in rows]
    greedy = [p.temperature == 0.0 for p in ps]
    temps = [1.0 if g else float(p.temperature) for p, g in zip(ps, greedy)]
    md = SamplingMetadata(
        num_rows=n,
        vocab_size=vocab_size,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        temperature=torch.tensor(temps, dtype=torch.float32, device=device),
        greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
        top_k=None,
        top_p=None,
        min_p=None,
    )
    sampled_rows = [i for i, g in enumerate(greedy) if not g]
    if any(ps[i].top_k > 0 for i in sampled_rows):
        md.top_k = torch.tensor(
            [p.top_k if (p.top_k > 0 and not g) else vocab_size for p, g in zip(ps, greedy)],
            dtype=torch.int64, device=device,
        ).clamp_(max=vocab_size)
    if any(ps[i].top_p < 1.0 for i in sampled_rows):
        md.top_p = torch.tensor([1.0 if g else p.top_p for p, g in zip(ps, greedy)], dtype=torch.float32, device=device)
    if any(ps[i].min_p > 0.0 for i in sampled_rows):
        md.min_p = torch.tensor([0.0 if g else p.min_p for p, g in zip(ps, greedy)], dtype=torch.float32, device=device)
    md.generators = {i: r.generator for i, r in enumerate(rows) if r.generator is not None and not greedy[i]}

    if any(p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1.0 for p in ps):
        md.presence_penalty = torch.tensor([p.presence_penalty for p in ps], dtype=torch.float32, device=device)
        md.frequency_penalty = torch.tensor([p.frequency_penalty for p in ps], dtype=torch.float32, device=device)
        md.repetition_penalty = torch.tensor([p.repetition_penalty for p in ps], dtype=torch.float32, device=device)
        md.output_token_ids = _pad([r.output_token_ids for r in rows], vocab_size, device)
        if any(p.repetition_penalty != 1.0 for p in ps):
            md.prompt_token_ids = _pad(
                [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in rows], vocab_size, device
            )

    b_rows, b_toks, b_vals = [], [], []
    for i, p in enumerate(ps):
        if p.logit_bias:
            for t, b in p.logit_bias.items():
                if t >= vocab_size:
                    raise ValueError(f"logit_bias token id {t} out of vocabulary (size {vocab_size})")
                b_rows.append(i)
                b_toks.append(t)
                b_vals.append(b)
    if b_rows:
        md.bias_rows = torch.tensor(b_rows, dtype=torch.int64, device=device)
        md.bias_tokens = torch.tensor(b_toks, dtype=torch.int64, device=device)
        md.bias_values = torch.tensor(b_vals, dtype=torch.float32, device=device)

    m_rows, m_toks = [], []
    for i, (p, r) in enumerate(zip(ps, rows)):
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
            stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(p.eos_token_ids))
            for t in stop_ids:
                if t < vocab_size:
                    m_rows.append(i)
                    m_toks.append(t)
    if m_rows:
        md.min_tok_rows = torch.tensor(m_rows, dtype=torch.int64, device=device)
        md.min_tok_tokens = torch.tensor(m_toks, dtype=torch.int64, device=device)

    lp = [p.logprobs for p in ps if p.logprobs is not None]
    if lp:
        md.max_num_logprobs = max(lp)
        modes = [resolve_logprobs_mode(p.logprobs_mode) if p.logprobs is not None else "raw_logprobs" for p in ps]
        proc = [m.startswith("processed") for m in modes]
        if any(proc):
            md.any_processed = True
            md.processed_logprobs_rows = torch.tensor(proc, dtype=torch.bool, device=device)
        as_logits = [m.endswith("logits") for m in modes]
        if any(as_logits):
            md.any_logits = True
            md.logits_rows = torch.tensor(as_logits, dtype=torch.bool, device=device)
    return md
