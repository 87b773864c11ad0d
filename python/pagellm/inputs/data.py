"""The prompt forms every front end accepts (vLLM's names), and what the input processor makes of them.

A prompt is one of:
    "Hello"                                   a plain str: tokenized with the model's tokenizer
    [1, 15043]                                a list of token ids
    {"prompt": "Hello"}                       TextPrompt
    {"prompt_token_ids": [1, 15043]}          TokensPrompt (an optional "prompt" keeps the text)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from typing_extensions import NotRequired, TypedDict

from pagellm.sampling_params import SamplingParams


class TextPrompt(TypedDict):
    """A text prompt. `add_special_tokens` (default True) is pagellm's: False for text that already
    carries them, such as a rendered chat template."""

    prompt: str
    add_special_tokens: NotRequired[bool]


class TokensPrompt(TypedDict):
    """A pre-tokenized prompt; `prompt` is its text, kept for the outputs when known."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]


@dataclass(frozen=True)
class ProcessedRequest:
    """A request's input after validation: ready to be registered with an engine as is.

    prompt: the prompt text, or None when only token ids were given.
    prompt_token_ids: [num_prompt_tokens] ids, each in [0, vocab_size), 0 < len < max_model_len.
    params: a private clone of the caller's SamplingParams, completed: max_tokens set (and
        len(prompt_token_ids) + max_tokens <= max_model_len), the model's EOS ids applied.
    """

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams

    def as_prompt(self) -> TokensPrompt:
        """The processed prompt as a TokensPrompt (processing it again only re-checks it)."""
        if self.prompt is None:
            return TokensPrompt(prompt_token_ids=self.prompt_token_ids)
        return TokensPrompt(prompt_token_ids=self.prompt_token_ids, prompt=self.prompt)
