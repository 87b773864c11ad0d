"""Incremental detokenization and stop-string detection.

Decoding one token at a time is wrong for byte-level and SentencePiece tokenizers: a character
can span several tokens (bytes), and a token's leading space depends on its left context. Like
vLLM we keep two offsets into the token list:

    prefix_offset: start of a few tokens of left context (already emitted),
    read_offset:   first token whose text has not been emitted yet,

and emit decode(tokens[prefix:]) minus decode(tokens[prefix:read]). Text that ends in U+FFFD
(an incomplete UTF-8 sequence) is held back until the next token completes it.
"""

from __future__ import annotations

from typing import Sequence

_REPLACEMENT = "\ufffd"
# Tokens of left context kept before the unread tokens.
_CONTEXT_TOKENS = 5


def decode_tokens(tokenizer, token_ids: Sequence[int], skip_special_tokens: bool = True,
                  spaces_between_special_tokens: bool = True) -> str:
    """tokenizer.decode without tokenization-space clean-up (which is not prefix-stable)."""
    ids = list(token_ids)
    try:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    except TypeError:  # a raw tokenizers.Tokenizer
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def backend_decoder(tokenizer):
    """The Rust `tokenizers.Tokenizer.decode` that `tokenizer.decode(ids, skip_special_tokens=s,
    clean_up_tokenization_spaces=False)` comes down to, when it does come down to exactly that: transformers' own
    fast-tokenizer class, its decode and _decode not overridden. Else None. Calling it directly skips ~10 us of
    transformers' argument handling per call (two calls per generated token)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase  # noqa: PLC0415
        from transformers.tokenization_utils_tokenizers import TokenizersBackend  # noqa: PLC0415
    except ImportError:  # another transformers layout: keep the public decode
        return None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode and callable(getattr(backend, "decode", None))):
        return backend.decode
    return None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a character."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # Left context: the prompt's last few tokens (so the first output token gets its leading
        # space right); they are never emitted.
        ctx = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.token_ids: list[int] = ctx
        self.prefix_offset = 0
        self.read_offset = len(ctx)
        self.output_text = ""
        self._backend_decode = backend_decoder(tokenizer)

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return decode_tokens(self.tokenizer, ids, self.skip_special_tokens, self.spaces_between_special_tokens)

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty) and append it to output_text."""
        self.token_ids.extend(int(t) for t in new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # nothing complete yet: hold the tokens back
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of the request: emit whatever is held back (an incomplete character decodes
        as U+FFFD, as a full decode of the output would)."""
        if self.read_offset >= len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta


def find_stop_string(text: str, num_new_chars: int, stop: Sequence[str], include_stop_str_in_output: bool
                     ) -> tuple[str, int] | None:
    """Look for a stop string that ends inside the last `num_new_chars` characters of `text`.

    Returns (stop_str, truncate_to) for the earliest match, the text to keep being
    text[:truncate_to], or None.
    """
    if not stop or num_new_chars <= 0:
        return None
    best: tuple[int, str] | None = None
    for s in stop:
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    return s, (idx + len(s) if include_stop_str_in_output else idx)


class StopStringChecker:
    """Detokenized text + stop strings, with what may be shown while streaming.

    While running, the last max_stop_len - 1 characters are held back (they could be the start of
    a stop string that must not leak); when finished everything that survives truncation is shown.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        self.stop = list(stop)
        self.include = include_stop_str_in_output
        self.holdback = 0 if (include_stop_str_in_output or not self.stop) else max(len(s) for s in self.stop) - 1
        self.text = ""
        self.stop_str: str | None = None

    def append(self, delta: str, check: bool = True) -> bool:
        """Add text; True when a stop string completed (text is then truncated).
        check=False appends without looking (before min_tokens)."""
        if not delta or self.stop_str is not None:
            return False
        self.text += delta
        if not check:
            return False
        hit = find_stop_string(self.text, len(delta), self.stop, self.include)
        if hit is None:
            return False
        self.stop_str, cut = hit
        self.text = self.text[:cut]
        return True

    def visible_text(self, finished: bool) -> str:
        if finished or self.holdback == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]
