"""`truncate_prompt_tokens` (vLLM's request field, completions and chat): keep only the last k prompt tokens.

    k >= 1   the prompt's last k tokens (a shorter prompt is kept whole)
    k = -1   as many of the last tokens as fit: max_model_len - max_tokens (1 when max_tokens is unset)
    None     no truncation: a prompt that does not fit is a 400 naming the lengths (inputs.PromptTooLongError)

Left truncation keeps what the model continues from, as eval harnesses do with over-long contexts. An
echoed prompt is the truncated one (its text decoded from the kept ids). Text prompts still pass the
character cap first (serving_base.check_prompt_chars): the tokenizer never sees an unbounded input.
"""

from __future__ import annotations

from pagellm.entrypoints.openai.serving_base import OpenAIError, ServingBase
from pagellm.sampling_params import SamplingParams


def kept_prompt_tokens(truncate_prompt_tokens: int, max_model_len: int, params: SamplingParams) -> int:
    """How many of the last prompt tokens to keep (>= 1), or OpenAIError (400)."""
    if truncate_prompt_tokens == -1:
        keep = max_model_len - (params.max_tokens or 1)
        if keep < 1:
            raise OpenAIError(f"max_tokens ({params.max_tokens}) leaves no room for a prompt in "
                              f"max_model_len={max_model_len}", param="max_tokens", code="context_length_exceeded")
        return keep
    if truncate_prompt_tokens < 1:
        raise OpenAIError(f"truncate_prompt_tokens must be >= 1 or -1 (as many as fit), got {truncate_prompt_tokens}",
                          param="truncate_prompt_tokens")
    return truncate_prompt_tokens


async def truncate_prompt(serving: ServingBase, prompt, params: SamplingParams, truncate_prompt_tokens: int | None):
    """`prompt` (a str, token ids, or a rendered chat prompt dict) left-truncated as the request asks; unchanged
    when it does not ask. A truncated prompt comes back as {"prompt_token_ids": [...]}, a kept one with its
    text too (so it is not tokenized twice)."""
    if truncate_prompt_tokens is None:
        return prompt
    keep = kept_prompt_tokens(truncate_prompt_tokens, serving.llm.max_model_len, params)
    text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
    if isinstance(text, str):
        serving.check_prompt_chars(len(text))
    await serving.llm.check_health()
    try:
        text, ids = await serving.llm.run_in_tokenizer_thread(serving.llm.input_processor.tokenize, prompt)
    except TypeError as e:  # the input processor's "wrong prompt form"
        raise OpenAIError(str(e), param="prompt") from e
    if len(ids) > keep:
        return {"prompt_token_ids": ids[-keep:]}
    return {"prompt_token_ids": ids} if text is None else {"prompt_token_ids": ids, "prompt": text}
