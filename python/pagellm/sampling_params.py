"""Sampling parameters for text generation, with vLLM's names and meanings."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from enum import IntEnum


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(IntEnum):
    """Which RequestOutputs LLMEngine.step returns for a request (vLLM's names and values). CUMULATIVE: one after
    every step that changed it, each holding everything so far; FINAL_ONLY: only the finished one. LLM.generate
    asks for FINAL_ONLY (it reads nothing else): building a batched decode step's 64 intermediate outputs was
    ~0.3 ms of the step's single-threaded host time (benchmarks/README.md, session 18)."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


# vLLM's logprobs_mode names: values from the model's logits (raw) or from the logits the token is drawn
# from (processed: after bias, min_tokens, penalties, temperature, min-p, top-k, top-p), as log-probabilities
# or as the logits themselves. "raw" / "processed" are this engine's older names for the *_logprobs ones.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
LOGPROBS_MODE_ALIASES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
_LOGPROBS_MODES = LOGPROBS_MODES + tuple(LOGPROBS_MODE_ALIASES)
MAX_SEED = 2**64 - 1  # torch.Generator seeds are unsigned 64-bit
MAX_INT64 = 2**63 - 1  # counts the C++ scheduler and torch index tensors hold
MAX_NUM_STOP_STRINGS = 64  # each generated token is checked against every stop string
MAX_STOP_STRING_LEN = 1024  # characters; streamed text is held back by the longest one
MIN_TEMPERATURE = 1e-2  # smaller positive temperatures are raised to this (vLLM's _MAX_TEMP):
# below it logits / temperature overflow float32
_BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                "detokenize")


def _bad(field_name: str, value, allowed: str) -> ValueError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."  # a huge value is not echoed whole
    return ValueError(f"{field_name} must be {allowed}, got {shown}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x) -> bool:
    """A real int / float that is finite as a float (an int too large for a float is not)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _int_in(x, lo: int, hi: int) -> bool:
    return _is_int(x) and lo <= x <= hi


def _as_list(value, field_name: str, allowed: str) -> list:
    if value is None:
        return []
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise TypeError(f"{field_name} must be {allowed}, got {type(value).__name__} {value!r}")
    return list(value)


def _logit_bias_entry(tok, bias) -> tuple[int, float]:
    """(token id, bias) from an int or decimal-string key (JSON keys are strings) and a real number."""
    if isinstance(tok, str) and tok.strip().lstrip("-").isdecimal():
        tok = int(tok)
    if not isinstance(tok, numbers.Integral) or isinstance(tok, bool):
        raise TypeError(f"logit_bias keys must be token ids (ints or decimal strings), got {tok!r}")
    if not isinstance(bias, numbers.Real) or isinstance(bias, bool):
        raise TypeError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {tok}")
    try:
        return int(tok), float(bias)
    except OverflowError:
        raise _bad("logit_bias", f"<a value too large for a float> for token {tok}", "values in [-100, 100]") from None


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    n: number of completions to return for the prompt (at most the engine's max_num_seqs).
    temperature: 0 means greedy (argmax of the raw logits); must be >= 0 and finite. As in vLLM, a
        positive temperature below MIN_TEMPERATURE (0.01) is raised to it.
    top_k: keep the k most likely tokens; -1 or 0 disables.
    top_p: nucleus sampling, in (0, 1]; 1 disables.
    min_p: drop tokens whose probability is below min_p * max probability, in [0, 1]; 0 disables.
    seed: per-request seed in [0, 2**64 - n] (sequence i is seeded seed + i); makes sampling
        reproducible whatever else is in the batch.
    presence_penalty / frequency_penalty: OpenAI-style, on generated tokens, in [-2, 2].
    repetition_penalty: HF-style on prompt + generated tokens, > 0; 1 disables.
    logit_bias: {token_id: bias} added to the logits; biases in [-100, 100], ids in the vocabulary.
    stop / stop_token_ids: generation stops at any of these (at most MAX_NUM_STOP_STRINGS stop
        strings of at most MAX_STOP_STRING_LEN characters; stop ids in the vocabulary). A stop string
        is cut from the text unless include_stop_str_in_output; a stop token id (or EOS) stays in
        token_ids but is kept out of the text unless include_stop_str_in_output.
    ignore_eos: keep generating after EOS.
    max_tokens: maximum number of generated tokens (default 16); None = up to max_model_len.
    min_tokens: EOS and stop_token_ids are masked until this many tokens were generated.
    logprobs: number of top logprobs per generated token (the sampled token is always included);
        at most the engine's max_logprobs (default 20).
    prompt_logprobs: number of top logprobs per prompt token; at most max_logprobs.
    logprobs_mode: what `logprobs` report for generated tokens (prompt logprobs are always raw):
        "raw_logprobs" (log_softmax of the model's logits), "raw_logits" (the logits themselves),
        "processed_logprobs" / "processed_logits" (after logit bias, min_tokens, penalties, temperature
        and min-p/top-k/top-p masking: what the token was drawn from; greedy rows have no temperature);
        "raw" / "processed" = the *_logprobs ones; None = the engine's logprobs_mode (default raw_logprobs).
    output_kind: RequestOutputKind.CUMULATIVE (default: an output after every step that changed the request) or
        FINAL_ONLY (only the finished output; what LLM.generate uses).
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
    logprobs_mode: str | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled in by the engine (EOS ids of the model, unless ignore_eos).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _normalize(self) -> None:
        """Canonical forms: stop / stop_token_ids as lists, logit_bias as {int: float} or None, top_k 0 as
        -1, a tiny positive temperature raised to MIN_TEMPERATURE. TypeError for containers of the wrong kind."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list(self.stop, "stop", "a string or a list of strings")
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids", "a list of token ids")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise TypeError(f"logit_bias must be a dict {{token_id: bias}}, got {type(self.logit_bias).__name__}")
        self.logit_bias = dict(_logit_bias_entry(k, v) for k, v in self.logit_bias.items()) if self.logit_bias else None
        if self.top_k == 0 and _is_int(self.top_k):
            self.top_k = -1
        if _finite(self.temperature) and 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    def _verify(self) -> None:
        """The one validation pass (construction, and again by the input processor on its clone, since
        fields may be set after construction): canonical forms, then every field's range. Raises
        ValueError / TypeError naming the field and its allowed values; the engine-dependent limits
        (vocabulary, max_logprobs, max_model_len, max_num_seqs) are checked by the input processor."""
        self._normalize()
        self._verify_sampling()
        self._verify_lengths_and_logprobs()
        self._verify_stops_and_flags()

    def _verify_sampling(self) -> None:
        if not _int_in(self.n, 1, MAX_INT64):
            raise _bad("n", self.n, "an integer >= 1")
        if not _finite(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if not _int_in(self.top_k, -1, MAX_INT64):
            raise _bad("top_k", self.top_k, "-1 or 0 (disabled) or an integer in [1, 2**63 - 1]")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "in (0, 1]")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "in [0, 1]")
        # sequence i of n draws from a generator seeded seed + i: all of them must be valid seeds
        if self.seed is not None and not _int_in(self.seed, 0, MAX_SEED - self.n + 1):
            raise _bad("seed", self.seed, f"None or an integer in [0, 2**64 - n] (= {MAX_SEED - self.n + 1} for "
                                          f"n={self.n}: sequence i is seeded seed + i)")
        if not _finite(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            raise _bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not _finite(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            raise _bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _bad("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 = off)")
        for tok, bias in (self.logit_bias or {}).items():
            if tok < 0:
                raise _bad("logit_bias", tok, "keyed by token ids >= 0")
            if not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
                raise _bad("logit_bias", bias, "values in [-100, 100]")

    def _verify_lengths_and_logprobs(self) -> None:
        if self.max_tokens is not None and not _int_in(self.max_tokens, 1, MAX_INT64):
            raise _bad("max_tokens", self.max_tokens, "an integer >= 1 or None")
        if not _int_in(self.min_tokens, 0, MAX_INT64):
            raise _bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not _int_in(self.logprobs, 0, MAX_INT64):
            raise _bad("logprobs", self.logprobs, "an integer >= 0 or None")
        if self.prompt_logprobs is not None and not _int_in(self.prompt_logprobs, 0, MAX_INT64):
            raise _bad("prompt_logprobs", self.prompt_logprobs, "an integer >= 0 or None")
        if self.logprobs_mode is not None and self.logprobs_mode not in _LOGPROBS_MODES:
            raise _bad("logprobs_mode", self.logprobs_mode, f"None or one of {_LOGPROBS_MODES}")
        if not _is_int(self.output_kind) or self.output_kind not in tuple(RequestOutputKind):
            raise _bad("output_kind", self.output_kind, "RequestOutputKind.CUMULATIVE or RequestOutputKind.FINAL_ONLY")
        self.output_kind = RequestOutputKind(self.output_kind)

    def _verify_stops_and_flags(self) -> None:
        if not all(isinstance(s, str) for s in self.stop):
            raise _bad("stop", self.stop, "a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise _bad("stop", self.stop, "non-empty strings")
        if len(self.stop) > MAX_NUM_STOP_STRINGS:
            raise ValueError(f"stop must be at most {MAX_NUM_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_STRING_LEN for s in self.stop):
            raise ValueError(f"stop must be strings of at most {MAX_STOP_STRING_LEN} characters, got one of "
                             f"{max(len(s) for s in self.stop)}")
        if not all(_int_in(t, 0, MAX_INT64) for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "True or False")
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


def resolve_logprobs_mode(mode: str | None, default: str = "raw_logprobs") -> str:
    """One of LOGPROBS_MODES for a request's (or the engine's) logprobs_mode; None -> `default`."""
    mode = default if mode is None else mode
    mode = LOGPROBS_MODE_ALIASES.get(mode, mode)
    if mode not in LOGPROBS_MODES:
        raise _bad("logprobs_mode", mode, f"one of {_LOGPROBS_MODES}")
    return mode
