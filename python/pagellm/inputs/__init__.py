"""Prompt inputs: the accepted prompt forms, the one input processor, chat templating.

    from pagellm.inputs import InputProcessor, TextPrompt, TokensPrompt
    proc = InputProcessor(tokenizer, vocab_size=32000, max_model_len=4096, eos_token_ids=[2])
    req = proc.process("Hello", SamplingParams(max_tokens=8))    # -> ProcessedRequest
"""

from pagellm.inputs.chat import apply_chat_template, chat_prompt
from pagellm.inputs.data import ProcessedRequest, PromptType, TextPrompt, TokensPrompt
from pagellm.inputs.processor import InputProcessor, PromptTooLongError

__all__ = [
    "InputProcessor", "ProcessedRequest", "PromptTooLongError", "PromptType", "TextPrompt", "TokensPrompt",
    "apply_chat_template", "chat_prompt",
]
