"""Which values a row's generated-token logprobs report (SamplingParams.logprobs_mode, vLLM's names):

    raw_logprobs        log_softmax(model logits)                       (the default)
    raw_logits          the model's logits, float32
    processed_logprobs  log_softmax(final)   final = the logits the token is drawn from: after logit bias,
    processed_logits    final                min_tokens, penalties, temperature, min-p, top-k, top-p
                                             (masked tokens -inf; greedy rows: no temperature)

The sampler and draft verification both call `logprob_values`, so a token's reported value does not
depend on whether it came from a plain step or a verified draft.
"""

from __future__ import annotations

import torch

from pagellm.sampling.metadata import SamplingMetadata


def logprob_values(raw_logits: torch.Tensor, final_logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """raw_logits, final_logits float32 [N, V] -> the values to report [N, V], each row in its own mode."""
    out = torch.log_softmax(raw_logits, dim=-1)
    if md.any_logits:
        out = torch.where(md.logits_rows.unsqueeze(1), raw_logits, out)
    if md.any_processed:
        processed = torch.log_softmax(final_logits, dim=-1)
        if md.any_logits:
            processed = torch.where(md.logits_rows.unsqueeze(1), final_logits, processed)
        out = torch.where(md.processed_logprobs_rows.unsqueeze(1), processed, out)
    return out
