"""InputProcessor: any accepted prompt + SamplingParams -> one validated ProcessedRequest.

The one place a request's input is checked. LLMEngine.add_request, LLM, AsyncLLM and the OpenAI
server all go through it, so a bad request is refused with the same error wherever it comes in,
before anything is registered anywhere. It holds no per-request state: one instance may serve
several threads as long as its tokenizer does.
"""

from __future__ import annotations

import numbers
from typing import Sequence

from pagellm.inputs.data import ProcessedRequest, PromptType
from pagellm.sampling_params import SamplingParams, resolve_logprobs_mode

DEFAULT_MAX_LOGPROBS = 20  # vLLM's default max_logprobs
_PROMPT_FORMS = "a str, a list of token ids, {'prompt': str} or {'prompt_token_ids': [...]}"


class PromptTooLongError(ValueError):
    """The prompt, or the prompt plus max_tokens, does not fit in max_model_len."""


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _token_id_list(ids) -> list[int]:
    """ids as a list of Python ints; TypeError for anything but a sequence of integers."""
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):  # numpy array, torch tensor
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
    for i, t in enumerate(ids):
        if not _is_token_id(t):
            raise TypeError(f"prompt_token_ids must be ints, got {type(t).__name__} {t!r} at position {i}")
    return [int(t) for t in ids]


class InputProcessor:
    """Turns prompts (see pagellm.inputs.data) and SamplingParams into ProcessedRequests.

    tokenizer: anything with `encode(text, add_special_tokens=...)` (a HF tokenizer, a raw
        `tokenizers.Tokenizer`), or None (then only token-id prompts are accepted).
    vocab_size: prompt token ids and logit_bias keys must lie in [0, vocab_size).
    max_model_len: prompt + generated tokens must fit; max_tokens=None means "up to it".
    eos_token_ids: the model's end-of-sequence ids (generation config), applied as stop ids.
    max_logprobs: the most logprobs / prompt_logprobs a request may ask for (vLLM's engine argument;
        -1 = the vocabulary size).
    max_num_seqs: the most sequences (n) one request may have; None = no limit.
    logprobs_mode: the engine's default for requests whose SamplingParams.logprobs_mode is None
        (vLLM's names: raw_logprobs, raw_logits, processed_logprobs, processed_logits).
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, *, eos_token_ids: Sequence[int] = (),
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, max_num_seqs: int | None = None,
                 logprobs_mode: str = "raw_logprobs") -> None:
        logprobs_mode = resolve_logprobs_mode(logprobs_mode)  # ValueError naming the allowed modes
        if not _is_token_id(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
        if not _is_token_id(max_model_len) or max_model_len < 1:
            raise ValueError(f"max_model_len must be an integer >= 1, got {max_model_len!r}")
        if not _is_token_id(max_logprobs) or max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0 or -1 (the vocabulary size), got {max_logprobs!r}")
        if max_num_seqs is not None and (not _is_token_id(max_num_seqs) or max_num_seqs < 1):
            raise ValueError(f"max_num_seqs must be an integer >= 1 or None, got {max_num_seqs!r}")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.max_model_len = int(max_model_len)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.max_logprobs = self.vocab_size if max_logprobs == -1 else min(int(max_logprobs), self.vocab_size)
        self.max_num_seqs = max_num_seqs
        self.logprobs_mode = logprobs_mode

    # ------------------------------------------------------------------ the one entry point
    def process(self, prompt: PromptType, params: SamplingParams | None = None) -> ProcessedRequest:
        """Validate and complete one request's input; nothing is registered anywhere.

        Raises TypeError for a prompt of the wrong type or non-integer token ids, and ValueError
        for invalid sampling parameters, an empty prompt, token ids outside the vocabulary,
        logit_bias / stop_token_ids outside it, logprobs / prompt_logprobs above max_logprobs, n above
        max_num_seqs, and (PromptTooLongError) a prompt that leaves no room for max_tokens in
        max_model_len.
        """
        params = self._validated_clone(params)
        text, ids = self.tokenize(prompt)
        self._check_prompt(ids)
        self._complete_params(params, len(ids))
        return ProcessedRequest(text, ids, params)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of any accepted prompt form. Checks the form and the
        id types, not lengths or the vocabulary (the /tokenize route counts any prompt)."""
        if isinstance(prompt, str):
            return prompt, self._encode(prompt, True)
        if isinstance(prompt, dict):
            return self._tokenize_dict(prompt)
        if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):
            return None, _token_id_list(prompt)
        raise TypeError(f"prompt must be {_PROMPT_FORMS}, got {type(prompt).__name__}")

    # ------------------------------------------------------------------ pieces
    def _tokenize_dict(self, prompt: dict) -> tuple[str | None, list[int]]:
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"prompt['prompt'] must be a str, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            return text, _token_id_list(prompt["prompt_token_ids"])
        if text is None:
            raise TypeError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        return text, self._encode(text, bool(prompt.get("add_special_tokens", True)))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass {'prompt_token_ids': [...]}")
        if not text:
            return []  # refused as empty, whatever special tokens a tokenizer would add
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:  # a tokenizer without the keyword
            ids = self.tokenizer.encode(text)
        return list(getattr(ids, "ids", ids))  # a raw tokenizers.Tokenizer returns an Encoding

    @staticmethod
    def _validated_clone(params: SamplingParams | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = params.clone()
        params._verify()  # fields may have been set after construction
        return params

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} out of vocabulary (valid range [0, {self.vocab_size}))")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; it must be shorter than max_model_len={self.max_model_len}")

    def _check_engine_limits(self, params: SamplingParams) -> None:
        """The limits SamplingParams cannot know: the vocabulary, max_logprobs, max_num_seqs."""
        if params.logit_bias and any(t >= self.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be < vocab size {self.vocab_size}")
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids must be < vocab size {self.vocab_size}, got {bad_stop[0]}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs={self.max_logprobs} (an engine argument), got {k}")
        if self.max_num_seqs is not None and params.n > self.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs={self.max_num_seqs} (the sequences a step can hold), "
                             f"got {params.n}")

    def _complete_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """Check the engine limits, fill in max_tokens, apply the EOS ids."""
        self._check_engine_limits(params)
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            params.max_tokens = room
            params._verify()  # min_tokens may exceed the room left
        elif params.max_tokens > room:
            raise PromptTooLongError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = "
                f"{num_prompt_tokens + params.max_tokens} exceeds max_model_len={self.max_model_len}; "
                f"lower max_tokens to <= {room}")
        params.update_from_generation_config(self.eos_token_ids)
        if params.logprobs_mode is None:
            params.logprobs_mode = self.logprobs_mode
