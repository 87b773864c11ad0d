"""The `ngram` method (prompt lookup decoding): drafts copied from earlier in the sequence itself.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 4})

For each sequence (prompt + output so far) the longest suffix of n tokens, n from prompt_lookup_max
down to prompt_lookup_min, that also occurred earlier is looked up; the tokens that followed its most
recent earlier occurrence are the drafts (read on from their start when they reach the end of the
sequence: a loop goes on). No model, no state between steps: it pays off where outputs copy their
input (rewriting, summarising, code edits) and costs one numpy scan per sequence elsewhere.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from pagellm.spec_decode.base import BaseProposer, DraftRequest
from pagellm.spec_decode.registry import ProposerContext, SpeculativeConfig, register_proposer

MAX_PROMPT_LOOKUP = 128  # longest n-gram matched; longer suffixes add nothing a 128-token match lacks


def find_ngram_continuation(token_ids: np.ndarray, min_n: int, max_n: int, num_tokens: int) -> np.ndarray:
    """Drafts for one sequence `token_ids` [num_ids] (int64): the `num_tokens` tokens following the most
    recent earlier occurrence of the longest suffix of length n in [min_n, max_n], read on cyclically
    when they reach the end of the sequence (empty: no match).

    Vectorised: the candidates are the earlier positions j holding the last token; their match length
    (how many tokens ending at j equal the suffix, at most max_n) grows one comparison over all
    candidates per step back, so the Python loop runs max_n times, never over the tokens."""
    last = len(token_ids) - 1
    if last < 1 or num_tokens < 1:
        return token_ids[:0]
    ends = np.flatnonzero(token_ids[:last] == token_ids[last])  # earlier occurrences' last positions
    if not len(ends):
        return token_ids[:0]
    length = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_n, last)):  # the suffix is token_ids[last - back .. last]
        pos = ends - back
        alive &= pos >= 0
        alive[alive] = token_ids[pos[alive]] == token_ids[last - back]
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < min_n:
        return token_ids[:0]
    start = int(ends[np.flatnonzero(length == best)[-1]]) + 1  # the most recent of the longest matches
    # a continuation cut off by the end of the sequence repeats: the suffix recurs after it, so what
    # followed the match follows again (a loop of period p yields k drafts, not p)
    return token_ids[start + np.arange(num_tokens) % (len(token_ids) - start)]


@register_proposer("ngram")
class NgramProposer(BaseProposer):
    """Prompt-lookup drafts (`find_ngram_continuation`) per sequence; sequences without a match get none."""

    OPTIONS = ("prompt_lookup_min", "prompt_lookup_max")
    # CPU decode is weight-bound at small batches, so scoring 1 + k tokens per row is nearly free there;
    # from a handful of rows on the forward turns compute-bound and rejected drafts cost real time.
    default_disable_by_batch_size = 4

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        super().__init__(num_speculative_tokens)
        self.check_options({"prompt_lookup_min": prompt_lookup_min, "prompt_lookup_max": prompt_lookup_max})
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        lo, hi = options.get("prompt_lookup_min", 1), options.get("prompt_lookup_max", 4)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PROMPT_LOOKUP:
                raise ValueError(f"speculative_config: {name} must be an integer in [1, {MAX_PROMPT_LOOKUP}], "
                                 f"got {value!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")

    @classmethod
    def from_config(cls, config: SpeculativeConfig, context: ProposerContext) -> "NgramProposer":
        return cls(config.num_speculative_tokens, **config.options)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for r in requests:
            ids = np.asarray(r.token_ids, dtype=np.int64)
            found = find_ngram_continuation(ids, self.prompt_lookup_min, self.prompt_lookup_max,
                                            min(self.num_speculative_tokens, r.max_num_drafts))
            if len(found):
                drafts[r.seq_id] = found.tolist()
        return drafts
