"""Sampling parameters for text generation, with vLLM's names and meanings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


_LOGPROBS_MODES = ("raw", "processed")


def _bad(field_name: str, value, allowed: str) -> ValueError:
    return ValueError(f"{field_name} must be {allowed}, got {value!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    n: number of completions to return for the prompt.
    temperature: 0 means greedy (argmax of the raw logits); must be >= 0 and finite.
    top_k: keep the k most likely tokens; -1 or 0 disables.
    top_p: nucleus sampling, in (0, 1]; 1 disables.
    min_p: drop tokens whose probability is below min_p * max probability, in [0, 1]; 0 disables.
    seed: per-request seed; makes sampling reproducible whatever else is in the batch.
    presence_penalty / frequency_penalty: OpenAI-style, on generated tokens, in [-2, 2].
    repetition_penalty: HF-style on prompt + generated tokens, > 0; 1 disables.
    logit_bias: {token_id: bias} added to the logits.
    stop / stop_token_ids: generation stops at any of these. A stop string is cut from the text
        unless include_stop_str_in_output; a stop token id (or EOS) stays in token_ids but is
        kept out of the text unless include_stop_str_in_output.
    ignore_eos: keep generating after EOS.
    max_tokens: maximum number of generated tokens (default 16); None = up to max_model_len.
    min_tokens: EOS and stop_token_ids are masked until this many tokens were generated.
    logprobs: number of top logprobs per generated token (the sampled token is always included).
    prompt_logprobs: number of top logprobs per prompt token.
    logprobs_mode: "raw" (log_softmax of the model's logits) or "processed" (after logit bias,
        penalties, temperature and top-k/top-p/min-p masking).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    logprobs_mode: str = "raw"
    # Filled in by the engine (EOS ids of the model, unless ignore_eos).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self.logit_bias = None if not self.logit_bias else {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.top_k == 0:
            self.top_k = -1
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "an integer >= 1")
        if not _finite(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "-1 or 0 (disabled) or an integer >= 1")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "in (0, 1]")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", self.seed, "an integer or None")
        if not _finite(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            raise _bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not _finite(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            raise _bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _bad("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 = off)")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if tok < 0:
                    raise _bad("logit_bias", tok, "keyed by token ids >= 0")
                if not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
                    raise _bad("logit_bias", bias, "values in [-100, 100]")
        if not all(isinstance(s, str) for s in self.stop):
            raise _bad("stop", self.stop, "a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise _bad("stop", self.stop, "non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", self.max_tokens, "an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise _bad("logprobs", self.logprobs, "an integer >= 0 or None")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise _bad("prompt_logprobs", self.prompt_logprobs, "an integer >= 0 or None")
        if self.logprobs_mode not in _LOGPROBS_MODES:
            raise _bad("logprobs_mode", self.logprobs_mode, f"one of {_LOGPROBS_MODES}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")

    # ------------------------------------------------------------------ helpers
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature == 0.0:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def update_from_generation_config(self, eos_token_ids) -> None:
        """Record the model's EOS ids as stop ids (kept out of the output unless ignore_eos)."""
        self.all_stop_token_ids = set(self.stop_token_ids)
        self._eos_token_ids = set(int(t) for t in (eos_token_ids or []))
        if not self.ignore_eos:
            self.all_stop_token_ids |= self._eos_token_ids

    @property
    def eos_token_ids(self) -> set[int]:
        return getattr(self, "_eos_token_ids", set())

    def clone(self) -> "SamplingParams":
        import copy

        return copy.deepcopy(self)
