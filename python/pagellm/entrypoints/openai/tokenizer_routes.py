"""GET /tokenizer_info: what a client needs to tokenize like the server without loading the tokenizer.

    {"tokenizer_class": "...", "eos_token": "</s>", "bos_token": "<s>", "pad_token": ..., "unk_token": ...,
     "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": ..., "chat_template": "..." | null,
     "model_max_length": <the server's max_model_len>, "vocab_size": ...}

vLLM's route name. lm-eval's `tokenizer_backend="remote"` (lm_eval.utils.RemoteTokenizer, also the
auto-detection of local-completions) reads `eos_token`, `bos_token`, `pad_token` and `chat_template` here,
then tokenizes through POST /tokenize {"prompt", "add_special_tokens": false} -> {"tokens"} and decodes
through POST /detokenize {"tokens"} -> {"prompt"} (api_server.py). Special tokens are the tokenizer's text
forms: /tokenize of `eos_token` gives back `[eos_token_id]`. /tokenize takes whole documents (perplexity
tasks): up to input_checks.max_tokenize_chars (1M characters), not the completions' 8 per max_model_len token.
lm-eval (0.4.13) reads no length from here: its `max_length` model arg (default 2048) must be set to fit.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol import OpenAIBaseModel

_SPECIAL_TOKENS = ("eos", "bos", "pad", "unk")


class TokenizerInfoResponse(OpenAIBaseModel):
    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    chat_template: str | None = None
    model_max_length: int
    vocab_size: int


def _text(value) -> str | None:
    """A special token as text (tokenizers may hold AddedToken objects)."""
    return None if value is None else str(getattr(value, "content", value))


def tokenizer_info(tokenizer, max_model_len: int, vocab_size: int) -> dict[str, Any]:
    """The /tokenizer_info body for `tokenizer` (an HF tokenizer, or None for a token-ids-only server)."""
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__ if tokenizer is not None else "None",
                            "model_max_length": int(max_model_len), "vocab_size": int(vocab_size)}
    for name in _SPECIAL_TOKENS:
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        info[f"{name}_token"] = _text(getattr(tokenizer, f"{name}_token", None))
        info[f"{name}_token_id"] = None if token_id is None else int(token_id)
    template = getattr(tokenizer, "chat_template", None)
    info["chat_template"] = template if isinstance(template, str) else None  # a dict of named ones: not shared
    return info


def tokenizer_router(async_llm: AsyncLLM) -> APIRouter:
    """The tokenizer-info route over `async_llm`'s tokenizer (included by build_app)."""
    router = APIRouter()

    @router.get("/tokenizer_info", response_model=None, responses=responses(TokenizerInfoResponse))
    async def get_tokenizer_info():
        return JSONResponse(tokenizer_info(async_llm.tokenizer, async_llm.max_model_len,
                                           async_llm.input_processor.vocab_size))

    return router
