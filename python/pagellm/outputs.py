"""What generation returns: RequestOutput > CompletionOutput, logprobs as vLLM shapes them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """A token's log-probability, its rank among the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: {token_id: Logprob}, the sampled/actual token always included.
SampleLogprobs = list[dict[int, Logprob]]
# Prompt logprobs: the first prompt token has no logprob (None).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class SpecDecodeMetrics:
    """Speculative-decoding counters (of one request, or engine-wide). A spec row is a step in which a
    sequence carried drafts: it emits its accepted drafts plus one token of the target's own."""

    num_spec_rows: int = 0
    num_draft_tokens: int = 0  # drafts scored by the target model
    num_accepted_draft_tokens: int = 0  # drafts the verifier accepted
    num_drafts_per_position: list[int] = field(default_factory=list)  # [i]: rows with a draft at position i
    num_accepted_per_position: list[int] = field(default_factory=list)  # [i]: rows whose draft i was accepted

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One spec row: its drafts, and how many of them (a prefix) the verifier accepted."""
        self.num_spec_rows += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_draft_tokens += num_accepted
        for counts, n in ((self.num_drafts_per_position, num_drafts), (self.num_accepted_per_position, num_accepted)):
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / scored drafts (0 before any draft)."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per spec row, the target's own token included (1 + accepted / rows; 0 before any)."""
        return 1.0 + self.num_accepted_draft_tokens / self.num_spec_rows if self.num_spec_rows else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """[i]: accepted / proposed drafts at draft position i."""
        return [a / d for a, d in zip(self.num_accepted_per_position + [0] * len(self.num_drafts_per_position),
                                      self.num_drafts_per_position)]


@dataclass
class RequestMetrics:
    """Timestamps (time.time()) of a request's life and the derived latencies in seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    spec_decode: SpecDecodeMetrics | None = None  # set once a step scored drafts for this request

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (over the longest completion)."""
        end = self.finished_time or self.last_token_time
        n = self.num_generation_tokens
        if self.first_token_time is None or end is None or n < 2:
            return None
        return (end - self.first_token_time) / (n - 1)


@dataclass
class CompletionOutput:
    """One completion of a request.

    finish_reason: None while running, then "stop" | "length" | "abort" | "error" (an engine step failed
        while the request was in it; RequestOutput.error says why).
    stop_reason: the stop string or stop token id that ended it (None for EOS or length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason})"
        )


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its n completions (one per child sequence).

    error: None, or why the request failed: an exception inside the engine step that ran it (model,
        sampler, detokenizer, proposer). The output is then final (finished=True), its unfinished
        completions have finish_reason "error", and the engine goes on with its other requests.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    encoder_prompt: str | None = field(default=None, repr=False)
    error: str | None = None

    def __repr__(self) -> str:
        error = "" if self.error is None else f", error={self.error!r}"
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={self.outputs}, finished={self.finished}, num_cached_tokens={self.num_cached_tokens}{error})"
        )
