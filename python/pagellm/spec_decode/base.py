"""The proposer contract of speculative decoding, and the checks the engine applies to proposals.

Before each step the engine hands its proposer every decode-ready sequence (a `DraftRequest`); the
proposer returns up to `max_num_drafts` guessed next tokens per sequence. The scheduler gives each
drafted sequence a row of 1 + k tokens, the model scores all of them in one forward, and the sampler's
`verify` keeps the longest acceptable prefix plus one token of its own. Outputs are the ones plain
decoding would produce (token-identical for greedy rows, identically distributed for sampled rows);
only the number of steps changes.

A proposer is one file subclassing `BaseProposer`:

    class RepeatLast(BaseProposer):
        def propose(self, requests):
            return {r.seq_id: [r.output_token_ids[-1]] * r.max_num_drafts for r in requests}

    engine.set_proposer(RepeatLast(num_speculative_tokens=3))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from pagellm.outputs import SpecDecodeMetrics

MAX_SPECULATIVE_TOKENS = 256  # the scheduler's bound on lookahead slots


@dataclass(frozen=True)
class DraftRequest:
    """One decode-ready sequence a proposer may draft for. The token lists are the engine's own: read only."""

    seq_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # drafts beyond this are dropped: num_speculative_tokens, less what max_tokens / max_model_len leave
    max_num_drafts: int

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (a new list)."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    @classmethod
    def for_sequence(cls, seq_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                     max_tokens: int | None, max_model_len: int, num_speculative_tokens: int) -> "DraftRequest | None":
        """The request for a sequence that may still emit drafts + one token (None when it may not)."""
        n_out = len(output_token_ids)
        limit = max_model_len - len(prompt_token_ids) - n_out
        if max_tokens is not None:
            limit = min(limit, max_tokens - n_out)
        room = min(limit - 1, num_speculative_tokens)  # the step's last token is the target's own
        return cls(seq_id, prompt_token_ids, output_token_ids, room) if room > 0 else None


class BaseProposer(ABC):
    """Guesses the next tokens of running sequences. Stateless between calls as far as the engine is
    concerned: a sequence may be preempted, aborted or forked between two calls."""

    # no drafts in a step with more decode-ready sequences than this, unless the speculative_config's
    # disable_by_batch_size says otherwise (None: always draft)
    default_disable_by_batch_size: int | None = None
    # True: after each step the engine calls observe_hidden_states with the final hidden state that gave
    # each sampled sequence its newest token (heads on the target's hidden states, e.g. medusa)
    needs_hidden_states: bool = False
    # the adaptive switch's EWMA weight of each verify's accepted count (spec_decode/switch.py): 0.3 follows a text
    # that turns repetitive or stops being so within a few verifies (n-gram matches); a proposer whose acceptance is
    # about the same from step to step, each verify a noisy sample of it, sets a smaller weight (a longer memory)
    acceptance_decay: float = 0.3

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """ValueError for a bad value among the method's own speculative_config keys (its OPTIONS);
        called by SpeculativeConfig.from_dict, so bad configs fail before an engine is built."""

    def __init__(self, num_speculative_tokens: int) -> None:
        if not isinstance(num_speculative_tokens, int) or not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {num_speculative_tokens!r}")
        self.num_speculative_tokens = num_speculative_tokens

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> Mapping[str, Sequence[int]]:
        """Drafts per seq_id for any subset of `requests` (a missing or empty entry: no drafts). At most
        num_speculative_tokens each; entries longer than a request's max_num_drafts are truncated."""

    def observe_hidden_states(self, seq_ids: Sequence[str], num_tokens: Sequence[int], hidden) -> None:
        """Only with needs_hidden_states: hidden [len(seq_ids), H] (the model's dtype) holds, per sequence,
        the final normed hidden state whose logits gave its newest token; the sequence then had
        num_tokens[i] tokens (prompt + output). Default: nothing."""

    def warm_caches(self) -> None:
        """Right after each step's target forward (whose weight stream has just evicted the caches), before the step's
        host bookkeeping: a proposer whose next propose() reads weights of its own may name them to be prefetched
        meanwhile (the CPU thread pool's idle workers). Default: nothing."""

    def set_draft_token_cost(self, cost: float | None) -> None:
        """Before each proposal with the adaptive switch on: a draft token's measured verify cost relative to one
        row's share of a plain step at this batch size (None: not measured yet), for proposers that size their
        drafts by cost. Default: nothing."""

    def release(self, seq_ids: Iterable[str]) -> None:
        """The sequences are gone (finished, aborted): drop any state kept for them. Default: nothing."""

    def reset_prefix_cache(self) -> None:
        """The engine's prefix cache was reset (`LLMEngine.reset_prefix_cache`): forget any prefix cache of the
        proposer's own (a draft model's KV blocks). Default: nothing."""


def check_proposals(requests: Sequence[DraftRequest], proposals: Mapping[str, Sequence[int]],
                    num_speculative_tokens: int, vocab_size: int) -> dict[str, list[int]]:
    """A proposer's answer, validated and truncated to each request's max_num_drafts. Raises KeyError for
    a seq_id that was not asked for, ValueError for more than num_speculative_tokens drafts or a token id
    outside [0, vocab_size)."""
    room = {r.seq_id: r.max_num_drafts for r in requests}
    drafts: dict[str, list[int]] = {}
    for seq_id, tokens in proposals.items():
        if seq_id not in room:
            raise KeyError(f"proposer returned drafts for {seq_id!r}, which was not among the requests")
        tokens = [int(t) for t in tokens]
        if len(tokens) > num_speculative_tokens:
            raise ValueError(f"proposer returned {len(tokens)} drafts for {seq_id!r}; at most "
                             f"num_speculative_tokens={num_speculative_tokens}")
        if any(t < 0 or t >= vocab_size for t in tokens):
            raise ValueError(f"draft token ids for {seq_id!r} must be in [0, {vocab_size})")
        if tokens[: room[seq_id]]:
            drafts[seq_id] = tokens[: room[seq_id]]
    return drafts


@dataclass
class SpecDecodeStats(SpecDecodeMetrics):
    """Engine-wide counters since the proposer was set (`LLMEngine.spec_stats`): the per-request ones
    summed, plus what only the engine sees."""

    num_emitted_tokens: int = 0  # tokens the spec rows added to outputs (after stop truncation)
    num_proposer_errors: int = 0  # steps whose propose() raised: they ran without drafts
    num_steps_over_batch_limit: int = 0  # steps without drafts: more decode-ready sequences than the limit

    def record(self, num_drafts: int, num_accepted: int, num_kept: int = 0) -> None:  # type: ignore[override]
        """One spec row: its drafts, the drafts accepted, the tokens kept after stop checks."""
        super().record(num_drafts, num_accepted)
        self.num_emitted_tokens += num_kept
