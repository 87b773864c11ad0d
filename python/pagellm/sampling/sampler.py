"""The sampler: logits [N, V] -> one token per row (+ logprobs), batched over requests.

Order of operations (each batched over rows, a no-op for rows that do not use it):
    logit_bias -> min_tokens (mask EOS / stop ids) -> penalties (repetition, frequency, presence)
    -> greedy rows: argmax (no temperature, so greedy is the argmax of the raw logits unless a
       bias/penalty/min_tokens is set for that row)
    -> temperature -> min_p -> top-k -> top-p -> sample with exponential races
Seeded rows draw their noise from their own torch.Generator, so their tokens do not depend on the
rest of the batch; unseeded rows share the engine's generator.
"""

from __future__ import annotations

import contextlib

import torch

from pagellm.sampling.logprobs_mode import logprob_values
from pagellm.sampling.metadata import SamplingMetadata
from pagellm.sampling.processors import (  # noqa: F401 (re-exported)
    LogprobsTensors,
    SamplerOutput,
    apply_logit_bias,
    apply_min_tokens,
    _token_counts,
    apply_penalties,
    apply_min_p,
    apply_top_k_top_p,
    has_logit_processors,
    apply_logit_processors,
    apply_sampling_filters,
    argmax_rows,
    compute_logprobs_tensors,
)
from pagellm.sampling.rejection import verify_drafts
from pagellm.sampling.typical import TypicalAcceptance


@contextlib.contextmanager
def one_intra_op_thread():
    """torch's intra-op parallelism off for the sampler's ops. Its vocabulary-wide elementwise ops (49k floats a row:
    ~10-40 us each on one thread) pass ATen's grain size, so each was an OpenMP region; right after a forward the
    kernels' pool threads still hold the cores (spin before sleep), and a region waits for them: the batch-1 sampled
    step's sampler took 17-20 ms of CPU (95-130 ms wall) on the loaded 2-core machine, 2.1-2.3 ms (8-10 ms) with one
    thread (session 16, bench in benchmarks/README.md). Same ops, same results: only the threading changes."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class Sampler(torch.nn.Module):
    """Batched sampler. `generator` draws the noise of unseeded rows (seeded from LLM(seed=...))."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.generator = generator
        self.typical_acceptance: TypicalAcceptance | None = None  # None: lossless rejection sampling

    def set_acceptance(self, rule: TypicalAcceptance | None) -> None:
        """How verify() accepts sampled rows' drafts: None = rejection sampling (lossless), a
        TypicalAcceptance = Medusa's typical acceptance (not lossless; sampling/typical.py)."""
        if rule is not None and not isinstance(rule, TypicalAcceptance):
            raise TypeError(f"rule must be a TypicalAcceptance or None, got {type(rule).__name__}")
        self.typical_acceptance = rule

    @torch.inference_mode()
    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits [N, V] in the model dtype; everything past a plain argmax runs in float32."""
        if md.all_greedy and md.max_num_logprobs is None and not has_logit_processors(md):
            return SamplerOutput(sampled_token_ids=argmax_rows(logits))  # exact in any dtype: no widening
        if logits.device.type != "cpu":
            return self._forward(logits, md)
        with one_intra_op_thread():
            return self._forward(logits, md)

    def _forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.to(torch.float32)
        processed = apply_logit_processors(logits, md)
        greedy_tokens = argmax_rows(processed) if not md.all_random else None
        if md.all_greedy:
            sampled = greedy_tokens
            final = processed
        else:
            final = apply_sampling_filters(processed, md)
            probs = torch.softmax(final, dim=-1)
            random_tokens = self._sample(probs, md)
            sampled = random_tokens if greedy_tokens is None else torch.where(md.greedy_mask, greedy_tokens, random_tokens)

        lp_out = None
        if md.max_num_logprobs is not None:  # processors and filters made new tensors: `logits` is raw
            lp_out = compute_logprobs_tensors(logprob_values(logits, final, md), sampled, md.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=lp_out)

    def verify(self, target_logits: torch.Tensor, draft_token_ids, md: SamplingMetadata,
               draft_probs: torch.Tensor | None = None):
        """Verify draft tokens: target_logits [sum(1 + k_i), V], k_i drafts per row, md with one row per
        target position -> VerifyOutput (accepted drafts + one token per row); see sampling/rejection.py."""
        args = (target_logits, draft_token_ids, md, draft_probs, self.generator, self.typical_acceptance)
        if target_logits.device.type != "cpu":
            return verify_drafts(*args)
        with one_intra_op_thread():
            return verify_drafts(*args)

    def _sample(self, probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """argmax(probs / q), q ~ Exp(1): a draw from probs (Gumbel-max in another guise)."""
        q = torch.empty_like(probs)
        n = probs.shape[0]
        if md.generators:
            seeded = torch.zeros(n, dtype=torch.bool)
            for i, g in md.generators.items():
                q[i].exponential_(generator=g)
                seeded[i] = True
            unseeded = (~seeded).nonzero().flatten().tolist()
            if unseeded:
                idx = torch.tensor(unseeded, device=probs.device)
                noise = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(generator=self.generator)
                q[idx] = noise
        else:
            q.exponential_(generator=self.generator)
        return probs.div(q).argmax(dim=-1)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Prompt logprobs (raw): logits [P, V] at prompt positions, target_ids [P] the next prompt tokens."""
    return compute_logprobs_tensors(torch.log_softmax(logits.to(torch.float32), dim=-1), target_ids, k)
