"""Verification of draft tokens (speculative decoding), lossless for greedy and sampled rows.

Row i carries k_i drafts d_0..d_{k-1} and 1 + k_i target positions, row by row: position j holds the
target model's logits for the token that follows d_{j-1} (the request's last token for j = 0), so
position j verifies d_j and the last one gives the bonus token. Every position goes through the same
logits processing as plain sampling (bias, min_tokens, penalties, temperature, min-p, top-k/p);
position j sees the row's outputs plus d_0..d_{j-1}, which is exactly the context it is reached in
(`expand_rows_for_verify` builds those rows).

Greedy rows: accept the longest prefix of drafts equal to the target argmax, then emit the argmax at the
first mismatch (or after all k drafts: the bonus token).
Sampled rows (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"):
accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a draw from
normalize(max(p_j - q_j, 0)); after all k accepted, a draw from p_k. q is one-hot on the draft when the
proposer gives no probabilities. The emitted tokens are distributed exactly as sampling from p one token
at a time.

Sampled rows with `acceptance` (sampling/typical.py, opt-in, NOT lossless): a draft is accepted when its target
probability exceeds the typical-acceptance threshold, and the token after the accepted ones is a draw from p_j.

Randomness, in a fixed order: rows in batch order; a sampled row draws k uniforms, then one Exp(1) noise
vector [V] (its final token is argmax(dist / noise)), from its own generator when seeded, else from the
sampler's. Greedy rows draw nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pagellm.sampling.logprobs_mode import logprob_values
from pagellm.sampling.metadata import SamplingMetadata, SamplingRow
from pagellm.sampling.typical import TypicalAcceptance
from pagellm.sampling.processors import (
    LogprobsTensors,
    apply_logit_processors,
    apply_sampling_filters,
    argmax_rows,
    compute_logprobs_tensors,
    has_logit_processors,
)


@dataclass
class VerifyOutput:
    accepted_token_ids: list[list[int]]  # per row: the accepted drafts + one corrected/bonus token
    num_accepted_tokens: list[int]  # per row: len(accepted_token_ids[i]), in [1, 1 + k_i]
    # [sum(1 + k_i), 1 + K] per target position, column 0 = the token emitted there; row i's emitted
    # token j sits at position (row i's first position) + j, later positions of the row are filler
    logprobs: LogprobsTensors | None = None


def expand_rows_for_verify(rows: Sequence[SamplingRow], draft_token_ids: Sequence[Sequence[int]],
                           draft_parents: Sequence[Sequence[int] | None] | None = None) -> list[SamplingRow]:
    """One SamplingRow per target position: position j of row i has the row's outputs plus the drafts that
    lead to it (a chain: its first j drafts; a tree, parents[i] given: draft j - 1 and its ancestors), copied
    only when the row's penalties or min_tokens read them."""
    out: list[SamplingRow] = []
    for i, (row, drafts) in enumerate(zip(rows, draft_token_ids)):
        p = row.params
        reads_outputs = (p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1.0
                         or (p.min_tokens and len(row.output_token_ids) < p.min_tokens))
        parents = None if draft_parents is None else draft_parents[i]
        leading: list[list[int]] = [[]]  # leading[j]: the drafts before position j, in order (when read)
        for j in range(len(drafts) if reads_outputs else 0):
            leading.append(leading[parents[j] + 1] + [drafts[j]] if parents is not None else list(drafts[: j + 1]))
        for j in range(len(drafts) + 1):
            outs = list(row.output_token_ids) + leading[j] if reads_outputs and j else row.output_token_ids
            out.append(SamplingRow(p, row.prompt_token_ids, outs, row.generator))
    return out


def target_probs(target_logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """[N, V] float32: the distributions sampled rows draw from (logits processing, filters, softmax)."""
    return _Targets(target_logits, md).probs


def _check_inputs(target_logits: torch.Tensor, draft_token_ids: Sequence[Sequence[int]], md: SamplingMetadata,
                  draft_probs: torch.Tensor | None) -> None:
    num_positions = sum(1 + len(d) for d in draft_token_ids)
    if target_logits.dim() != 2 or target_logits.shape[0] != num_positions:
        raise ValueError(f"target_logits must be [sum(1 + k_i) = {num_positions}, V], got {tuple(target_logits.shape)}")
    if md.num_rows != num_positions:
        raise ValueError(f"sampling metadata has {md.num_rows} rows; verify needs one per target position "
                         f"({num_positions}): build it from expand_rows_for_verify()")
    vocab = target_logits.shape[1]
    if any(t < 0 or t >= vocab for d in draft_token_ids for t in d):
        raise ValueError(f"draft token ids must be in [0, {vocab})")
    num_drafts = num_positions - len(draft_token_ids)
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts, vocab):
        raise ValueError(f"draft_probs must be [sum(k_i) = {num_drafts}, {vocab}], got {tuple(draft_probs.shape)}")


def _first_rejection(accepted: list[bool]) -> int:
    """Index of the first False, or len(accepted)."""
    for j, ok in enumerate(accepted):
        if not ok:
            return j
    return len(accepted)


class _Targets:
    """The processed target distributions of one verify call."""

    def __init__(self, target_logits: torch.Tensor, md: SamplingMetadata) -> None:
        if md.all_greedy and md.max_num_logprobs is None and not has_logit_processors(md):
            # the argmax of the model-dtype logits is exact (widening changes no order) and skips a float32 copy
            # of [1 + k, V]: an OpenMP region that waited 5-15 ms for a preempted thread on a loaded 2-core machine
            self.logits = self.final = target_logits
            self.greedy, self.probs = argmax_rows(target_logits).tolist(), None
            return
        self.logits = target_logits.to(torch.float32)
        processed = apply_logit_processors(self.logits, md)
        self.greedy = argmax_rows(processed).tolist() if not md.all_random else None
        self.final = processed if md.all_greedy else apply_sampling_filters(processed, md)
        self.probs = None if md.all_greedy else torch.softmax(self.final, dim=-1)

    def logprobs(self, md: SamplingMetadata, tokens: torch.Tensor) -> LogprobsTensors | None:
        """Logprobs of `tokens` [T] (raw, or processed for rows in processed mode), as the sampler's."""
        if md.max_num_logprobs is None:
            return None
        return compute_logprobs_tensors(logprob_values(self.logits, self.final, md), tokens, md.max_num_logprobs)


def _sample_row(t: _Targets, start: int, drafts: Sequence[int], draft_start: int, draft_probs: torch.Tensor | None,
                gen: torch.Generator | None, typical: TypicalAcceptance | None = None) -> tuple[int, int]:
    """Rejection-sample one row (typical: accept by that rule instead): (number of accepted drafts, the token
    emitted after them)."""
    k = len(drafts)
    probs = t.probs
    cpu = gen.device if gen is not None else torch.device("cpu")
    u = torch.rand(k, generator=gen, device=cpu)  # drawn by both rules: the noise stream does not depend on the rule
    noise = torch.empty(probs.shape[1], device=cpu).exponential_(generator=gen).to(probs.device)
    if typical is not None:
        num_ok = typical.num_accepted(probs[start : start + k], list(drafts))
        return num_ok, int((probs[start + num_ok] / noise).argmax())
    if k:
        ids = torch.tensor(drafts, dtype=torch.int64, device=probs.device)
        p = probs[start : start + k].gather(1, ids.unsqueeze(1)).squeeze(1)
        q = (torch.ones_like(p) if draft_probs is None
             else draft_probs[draft_start : draft_start + k].to(p.dtype).gather(1, ids.unsqueeze(1)).squeeze(1))
        accept = (p / q).clamp(max=1.0)  # q(d) = 0 gives inf: always accepted
        num_ok = _first_rejection((u.to(accept.device) < accept).tolist())
    else:
        num_ok = 0
    dist = probs[start + num_ok]
    if num_ok < k:
        if draft_probs is None:
            q_row = torch.zeros_like(dist)
            q_row[drafts[num_ok]] = 1.0
        else:
            q_row = draft_probs[draft_start + num_ok].to(dist.dtype)
        residual = (dist - q_row).clamp(min=0.0)
        if float(residual.sum()) > 0.0:  # all zero only when p == q up to rounding: then p itself
            dist = residual
    return num_ok, int((dist / noise).argmax())


@torch.inference_mode()
def verify_drafts(target_logits: torch.Tensor, draft_token_ids: Sequence[Sequence[int]], md: SamplingMetadata,
                  draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None,
                  typical: TypicalAcceptance | None = None) -> VerifyOutput:
    """Verify each row's drafts against the target model.

    target_logits: [sum(1 + k_i), V] (any float dtype), row by row. draft_token_ids: k_i >= 0 drafts
    per row. md: one row per target position (build_sampling_metadata(expand_rows_for_verify(...))).
    draft_probs: [sum(k_i), V] the proposer's distributions q, or None for a deterministic proposer
    (one-hot q). generator: the noise of unseeded sampled rows. typical: accept sampled rows' drafts by
    typical acceptance (not lossless) instead of rejection sampling. Raises ValueError on mismatched shapes
    or draft ids outside the vocabulary.
    """
    _check_inputs(target_logits, draft_token_ids, md, draft_probs)
    t = _Targets(target_logits, md)
    # plain_greedy_metadata (every row plain greedy) carries no per-row tensors: all rows greedy, no logprobs
    greedy_rows = md.greedy_mask.tolist() if md.greedy_mask is not None else [True] * md.num_rows
    tokens = torch.zeros(target_logits.shape[0], dtype=torch.int64) if md.max_num_logprobs is not None else None
    accepted: list[list[int]] = []
    start = draft_start = 0
    for drafts in draft_token_ids:
        k = len(drafts)
        if greedy_rows[start]:
            num_ok = _first_rejection([t.greedy[start + j] == drafts[j] for j in range(k)])
            token = t.greedy[start + num_ok]
        else:
            gen = md.generators.get(start, generator)
            num_ok, token = _sample_row(t, start, drafts, draft_start, draft_probs, gen, typical)
        row = list(drafts[:num_ok]) + [token]
        if tokens is not None:  # the emitted tokens' positions, for their logprobs
            if k:  # filler after the emitted token: logprobs there are never read
                tokens[start : start + k] = torch.tensor(list(drafts), dtype=torch.int64)
            tokens[start + num_ok] = token
        accepted.append(row)
        start += k + 1
        draft_start += k
    lp = None if tokens is None else t.logprobs(md, tokens.to(target_logits.device))
    return VerifyOutput(accepted_token_ids=accepted, num_accepted_tokens=[len(r) for r in accepted], logprobs=lp)
