"""Chat templating, in one place: `LLM.chat`, the server's /v1/chat/completions and /tokenize, and
`pagellm generate` all render a conversation here, so the same messages give the same prompt."""

from __future__ import annotations

from typing import Any

from pagellm.inputs.data import TextPrompt


def _chatml(messages: list[dict], add_generation_prompt: bool, continue_final_message: bool) -> str:
    """ChatML, for tokenizers without a chat template."""
    parts = []
    for i, m in enumerate(messages):
        if continue_final_message and i == len(messages) - 1:
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}")
        else:
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt and not continue_final_message:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if not messages:
        raise ValueError("messages must be a non-empty list")


def apply_chat_template(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, chat_template: str | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The conversation as prompt text: `chat_template` (a Jinja string) or else the tokenizer's own
    template; ChatML when the tokenizer has none. continue_final_message leaves the last message open
    for the model to continue, so no generation prompt is added after it."""
    _check_messages(messages)
    has_template = chat_template is not None or getattr(tokenizer, "chat_template", None)
    if not (has_template and hasattr(tokenizer, "apply_chat_template")):
        return _chatml(messages, add_generation_prompt, continue_final_message)
    kwargs = dict(chat_template_kwargs or {})
    if continue_final_message:  # only when set: not every apply_chat_template takes it
        kwargs["continue_final_message"] = True
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message, **kwargs)


def chat_prompt(tokenizer, messages: list[dict], **kwargs: Any) -> TextPrompt:
    """The conversation as a TextPrompt for the input processor (keywords as apply_chat_template).
    The rendered template already carries BOS and the like: no special tokens are added again."""
    return TextPrompt(prompt=apply_chat_template(tokenizer, messages, **kwargs), add_special_tokens=False)
