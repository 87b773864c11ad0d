"""Batched sampling: logits processors, top-k/top-p/min-p, seeded per-request generators, logprobs."""

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

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "build_sampling_metadata",
    "compute_logprobs_tensors",
    "compute_prompt_logprobs",
]
