"""Checks on raw client input that the server makes before anything expensive (tokenizing, rendering a
chat template, admitting a request), and the rule for quoting input back in error messages.

    find_lone_surrogate({"prompt": "a\\ud800"})    -> ("prompt", 1)   (JSON "\\ud800" decodes to one)
    prompt_chars_message(len(text), max_model_len) -> the 400 message beyond MAX_CHARS_PER_TOKEN x max_model_len
    prompt_chars_message(len(text), max_model_len, tokenize_only=True)
                                                   -> the same beyond max_tokenize_chars(max_model_len) (/tokenize)
    quote_input("x" * 10_000)                      -> "'xxxx…' (10000 chars)"
"""

from __future__ import annotations

from typing import Any

# No tokenizer we serve packs more than this many characters into one token on ordinary text, so a prompt
# longer than this many characters per max_model_len token cannot fit: it is refused before the tokenizer
# spends seconds on it (a 10 MB prompt held the one tokenizer thread, and so every client, for 16 s).
MAX_CHARS_PER_TOKEN = 8
# POST /tokenize only tokenizes (nothing reaches the engine, so max_model_len does not bound what is useful):
# lm-eval's remote tokenizer sends whole documents there for perplexity (wikitext pages run to ~100k
# characters). Its cap bounds only tokenizer time, ~0.2 s per 100k characters on one thread: 1M characters
# hold one tokenizer thread ~2 s, and the body stays under the 4 MiB request cap.
TOKENIZE_MAX_CHARS = 1_000_000
# The request-body cap (--max-request-bytes): 4 MiB holds the longest prompt accepted for a 128k-token
# context (8 characters per token: ~1 MB of text) with room for JSON escapes, and bounds what one request
# can make the server read, parse and hold.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
QUOTE_CHARS = 40           # at most this much of a client's input is quoted back in an error message
MAX_ERROR_MESSAGE_CHARS = 500   # the most of any error message (a safety net over quote_input)


def quote_input(value: Any, limit: int = QUOTE_CHARS) -> str:
    """A short, ASCII-safe quote of client input for an error message: repr of at most `limit` chars."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} chars)"


def safe_message(message: str, limit: int = MAX_ERROR_MESSAGE_CHARS) -> str:
    """message cut to `limit` chars and made encodable as UTF-8 (a lone surrogate would fail the JSON
    encoder: the error answer itself must never fail)."""
    if len(message) > limit:
        message = message[:limit] + "… (truncated)"
    if not message.isascii():
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return message


def _surrogate_index(text: str) -> int | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _loc_part(key: Any) -> str:
    text = str(key)
    return text if len(text) <= 20 and _surrogate_index(text) is None else quote_input(text, 20)


def _path_text(node) -> str:
    parts = []
    while node is not None:
        node, key = node
        parts.append(_loc_part(key))
    return ".".join(reversed(parts))


def find_lone_surrogate(obj: Any) -> tuple[str, int] | None:
    """(dotted location, character index) of a string (or dict key) holding a lone UTF-16 surrogate,
    or None when there is none. Python's JSON decoder turns "\\ud800" without its pair into such a string; no
    tokenizer or UTF-8 encoder accepts it. Iterative (JSON nested as deep as the decoder allows is fine),
    and a location is only spelled out once found (a 4 MB body of token ids costs ~0.1 s, like parsing it)."""
    stack: list[tuple[Any, Any]] = [(obj, None)]  # (value, its path as a (parent path, key) chain)
    while stack:
        item, node = stack.pop()
        if isinstance(item, str):
            i = _surrogate_index(item)
            if i is not None:
                return _path_text(node) or "body", i
        elif isinstance(item, dict):
            for key, value in item.items():
                if isinstance(key, str) and (i := _surrogate_index(key)) is not None:
                    return _path_text((node, key)) + " (a key)", i
                if isinstance(value, (str, dict, list)):
                    stack.append((value, (node, key)))
        elif isinstance(item, list):
            for index, value in enumerate(item):
                if isinstance(value, (str, dict, list)):
                    stack.append((value, (node, index)))
    return None


def lone_surrogate_message(where: str, index: int) -> str:
    return (f"{where}: invalid Unicode: a lone UTF-16 surrogate at character {index} (a \\ud800-\\udfff escape "
            f"without its pair); send valid UTF-8 text")


def max_prompt_chars(max_model_len: int) -> int:
    return MAX_CHARS_PER_TOKEN * int(max_model_len)


def max_tokenize_chars(max_model_len: int) -> int:
    """/tokenize's character cap: TOKENIZE_MAX_CHARS, or the prompt cap when a huge context makes that larger."""
    return max(TOKENIZE_MAX_CHARS, max_prompt_chars(max_model_len))


def prompt_chars_message(num_chars: int, max_model_len: int, param: str = "prompt",
                         tokenize_only: bool = False) -> str | None:
    """The error for a prompt too long to tokenize, or None when num_chars is acceptable. tokenize_only:
    the text is only tokenized (/tokenize), under max_tokenize_chars instead of the prompt cap."""
    if tokenize_only:
        limit = max_tokenize_chars(max_model_len)
        if num_chars <= limit:
            return None
        return f"{param} has {num_chars} characters; /tokenize accepts at most {limit}"
    limit = max_prompt_chars(max_model_len)
    if num_chars <= limit:
        return None
    return (f"{param} has {num_chars} characters; at most {limit} ({MAX_CHARS_PER_TOKEN} per token of "
            f"max_model_len={max_model_len}) are accepted")
