"""Batched sampling: logits processors, top-k/top-p/min-p, seeded per-request generators, logprobs,
and verification of speculative draft tokens (rejection.py)."""

from pagellm.sampling.metadata import SamplingMetadata, SamplingRow, build_sampling_metadata
from pagellm.sampling.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    compute_logprobs_tensors,
    compute_prompt_logprobs,
)
from pagellm.sampling.rejection import VerifyOutput, expand_rows_for_verify, verify_drafts

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "VerifyOutput",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "build_sampling_metadata",
    "compute_logprobs_tensors",
    "compute_prompt_logprobs",
    "expand_rows_for_verify",
    "verify_drafts",
]
