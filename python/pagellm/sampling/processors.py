"""Logits processing shared by sampling and draft verification: bias, min_tokens, penalties,
temperature/min-p/top-k/top-p filters, the row argmax and logprob gathering (all batched over rows)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagellm.sampling.metadata import SamplingMetadata
from pagellm.sampling.top_k_top_p import apply_top_k_top_p, apply_top_k_top_p_sorted  # noqa: F401 (re-exported)


@dataclass
class LogprobsTensors:
    """Column 0 is the sampled (or target) token; columns 1..K the top-K tokens, best first."""

    token_ids: torch.Tensor  # int64 [N, 1 + K]
    logprobs: torch.Tensor  # float32 [N, 1 + K]
    ranks: torch.Tensor  # int64 [N, 1 + K] (1 = most likely)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [N]
    logprobs: LogprobsTensors | None = None


def apply_logit_bias(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.bias_rows is not None:
        logits.index_put_((md.bias_rows, md.bias_tokens), md.bias_values, accumulate=True)
    return logits


def apply_min_tokens(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.min_tok_rows is not None:
        logits[md.min_tok_rows, md.min_tok_tokens] = float("-inf")
    return logits


def _token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 [N, L] padded with vocab_size -> counts [N, V]."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF: seen in prompt or output -> positive / p, negative * p), then frequency and
    presence on output tokens (OpenAI: logit -= f * count + p * [count > 0])."""
    if md.repetition_penalty is None:
        return logits
    v = md.vocab_size
    out_counts = _token_counts(md.output_token_ids, v)
    out_seen = out_counts > 0
    rp = md.repetition_penalty.unsqueeze(1)
    if md.prompt_token_ids is not None:
        seen = out_seen | (_token_counts(md.prompt_token_ids, v) > 0)
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen & (rp != 1.0), penalized, logits)
    logits = logits - md.frequency_penalty.unsqueeze(1) * out_counts.to(logits.dtype)
    logits = logits - md.presence_penalty.unsqueeze(1) * out_seen.to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def has_logit_processors(md: SamplingMetadata) -> bool:
    """Whether some row has a logit bias, a min_tokens mask or a penalty."""
    return md.bias_rows is not None or md.min_tok_rows is not None or md.repetition_penalty is not None


def apply_logit_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """float32 logits [N, V] -> bias, min_tokens and penalties applied (a new tensor when any applies)."""
    if not has_logit_processors(md):
        return logits
    processed = apply_logit_bias(logits.clone(), md)
    processed = apply_min_tokens(processed, md)
    return apply_penalties(processed, md)


def apply_sampling_filters(processed: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Processed float32 logits [N, V] -> temperature, min-p, top-k, top-p: the logits random rows sample from."""
    final = processed / md.temperature.unsqueeze(1)
    if md.min_p is not None:
        final = apply_min_p(final, md.min_p)
    return apply_top_k_top_p(final, md.top_k, md.top_p)


SMALL_ROWS = 16  # up to this many rows, the torch fallback reduces row by row (no OpenMP region)
_ARGMAX_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _argmax_op():
    """torch.ops.pagellm.argmax_rows when the compiled ops are loaded, else None (looked up once: the torch.ops
    namespace lookup costs microseconds a step)."""
    from pagellm import ops

    return torch.ops.pagellm.argmax_rows if ops.ops_available()[0] else None


def argmax_rows(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """x.argmax(-1) for a 2-D x, with torch's semantics (the first index of the maximum; NaN counts as the
    maximum), in any float dtype. On the CPU: the `argmax_rows` op (one vectorized pass per row, rows spread over
    pagellm's thread pool, no OpenMP region: torch's amax / argmax reductions waited 5-15 ms for a preempted
    OpenMP worker on a loaded 2-core machine, bench_batch_profile.py). Without the compiled ops (and off the CPU,
    where torch's argmax is used): one row is torch.max over the row, up to SMALL_ROWS rows the same row by row,
    more rows the maxima of blocks of `block` columns, the first block holding the row's maximum, then the argmax
    inside that one block (torch's CPU argmax reduction is ~5x slower than amax)."""
    n, v = x.shape
    if x.device.type == "cpu" and n > 0 and v > 0 and x.dtype in _ARGMAX_OP_DTYPES:
        op = _argmax_op()
        if op is not None:
            out = torch.empty(n, dtype=torch.int64)
            op(out, x)
            return out
    if n == 1 and x.device.type == "cpu":  # same first-maximum / NaN rule as argmax (tests/engine/test_sampler.py)
        return x.max(dim=-1).indices
    if 1 < n <= SMALL_ROWS and x.device.type == "cpu":  # a verify step's 1 + k rows: one single-thread reduction each
        return torch.stack([row.max(dim=-1).indices for row in x])
    if n == 0 or v < 4 * block or x.device.type != "cpu":
        return x.argmax(dim=-1)
    vb = v // block * block
    bmax = x[:, :vb].reshape(n, vb // block, block).amax(dim=-1)  # a view of x: no copy
    if vb < v:
        bmax = torch.cat([bmax, x[:, vb:].amax(dim=-1, keepdim=True)], dim=1)
    b = bmax.argmax(dim=-1)  # first block whose maximum is the row's maximum (NaN first, as in argmax)
    cols = (b.unsqueeze(1) * block + torch.arange(block, device=x.device)).clamp_(max=v - 1)
    # clamping repeats column v-1 after itself in a short last block, which cannot move the first maximum
    return b * block + x.gather(1, cols).argmax(dim=-1)


def compute_logprobs_tensors(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """logprobs [N, V] float32, token_ids [N] -> sampled/target token + top-k, with ranks."""
    tok = token_ids.to(device=logprobs.device, dtype=torch.int64).unsqueeze(1)
    tok_lp = logprobs.gather(1, tok)
    tok_rank = (logprobs > tok_lp).sum(dim=-1, keepdim=True) + 1
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        top_ranks = torch.arange(1, k + 1, device=logprobs.device).expand(logprobs.shape[0], k)
        return LogprobsTensors(
            token_ids=torch.cat([tok, top_ids], dim=1),
            logprobs=torch.cat([tok_lp, top_lp], dim=1),
            ranks=torch.cat([tok_rank, top_ranks], dim=1),
        )
    return LogprobsTensors(token_ids=tok, logprobs=tok_lp, ranks=tok_rank)
