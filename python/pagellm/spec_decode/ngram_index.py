"""Incremental prompt-lookup matching for the `ngram` method (ngram.py): one `SequenceMatcher` per running sequence.

A sequence only grows (accepted tokens are appended; preemption recomputes the same tokens; a fork is a new
sequence), so its matcher indexes each token once: the positions of every token id, and the match it follows. Per
step it costs the tokens accepted since the last step plus, when the followed match broke, one lookup over the
earlier occurrences of the last token (numpy over those positions, at most prompt_lookup_max comparisons each),
never a scan of the whole sequence.

Which match (longest first): among the earlier occurrences of the sequence's suffix, the one whose agreement with the
suffix, counted up to prompt_lookup_max tokens, is longest; on a tie the match already followed, else the most recent
(ngram_match.find_ngram_continuation's rule). A match is followed while the text keeps agreeing with it: after each
appended token that equals the token after the match's end, the match moves on by one and its length grows past
prompt_lookup_max. That length (tokens known to agree) is what the per-request draft length reads: a long copy run
drafts up to k tokens, a 1-2 token coincidence drafts 1-2. A matcher given a `ContinuationStats` (ngram_policy.py)
records, for every appended token it meets while following a match, the match's agreed length and whether the token
agreed with it: what `"draft_length": "cost"` reads to size drafts.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pagellm.spec_decode.ngram_policy import ContinuationStats


class SequenceMatcher:
    """One sequence's tokens (append-only), the positions of each token id, and the followed match."""

    def __init__(self, stats: ContinuationStats | None = None) -> None:
        self.stats = stats  # where each followed match's outcome per appended token goes (None: nowhere)
        self.tokens = np.empty(64, dtype=np.int64)
        self.num_tokens = 0
        self.positions: dict[int, list[int]] = {}  # token id -> its positions, ascending
        self.match_end = -1  # tokens[match_end - match_len + 1 .. match_end] == the suffix (-1: no match)
        self.match_len = 0  # agreeing tokens, at least prompt_lookup_min; grows past prompt_lookup_max as followed

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens (the sequence's next ones), following the current match through them."""
        n = self.num_tokens
        if n + len(new_tokens) > len(self.tokens):
            grown = np.empty(max(2 * len(self.tokens), n + len(new_tokens)), dtype=np.int64)
            grown[:n] = self.tokens[:n]
            self.tokens = grown
        tokens, positions, stats = self.tokens, self.positions, self.stats
        for t in new_tokens:
            t = int(t)
            if self.match_end >= 0:
                went_on = tokens[self.match_end + 1] == t  # match_end + 1 <= n - 1: an earlier position
                if stats is not None:
                    stats.record(self.match_len, went_on)
                if went_on:
                    self.match_end += 1
                    self.match_len += 1
                else:
                    self.match_end, self.match_len = -1, 0
            tokens[n] = t
            positions.setdefault(t, []).append(n)
            n += 1
        self.num_tokens = n

    def find(self, min_n: int, max_n: int, measure_n: int = 0) -> tuple[int, int]:
        """(end position, agreeing length) of the match the drafts follow; (-1, 0) when no earlier occurrence agrees
        with at least min_n tokens of the suffix. A newly found match that agrees with all max_n tokens compared has
        its agreement measured on, up to measure_n tokens (the draft length wants it: a long copy found at once)."""
        n = self.num_tokens
        if self.match_end >= 0 and self.match_len >= max_n:
            return self.match_end, self.match_len  # nothing can beat it at the cap (ties go to the followed one)
        if n < 2:
            return -1, 0
        tokens = self.tokens
        ends = np.asarray(self.positions[int(tokens[n - 1])][:-1], dtype=np.int64)  # the last token's earlier ones
        if not len(ends):
            return -1, 0
        length = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for back in range(1, min(max_n, n - 1)):
            pos = ends - back
            alive &= pos >= 0
            if not alive.any():
                break
            alive[alive] = tokens[pos[alive]] == tokens[n - 1 - back]
            length += alive
        best = int(length.max())
        if self.match_end >= 0 and self.match_len >= best:
            return self.match_end, self.match_len
        if best < min_n:
            self.match_end, self.match_len = -1, 0
            return -1, 0
        end = int(ends[np.flatnonzero(length == best)[-1]])
        while best < measure_n and end - best >= 0 and tokens[end - best] == tokens[n - 1 - best]:
            best += 1
        self.match_end, self.match_len = end, best
        return end, best

    def continuation(self, end: int, num_tokens: int) -> np.ndarray:
        """The num_tokens tokens after `end`, read on cyclically at the sequence's end (ngram_match.continuation)."""
        start = end + 1
        return self.tokens[start + np.arange(num_tokens) % (self.num_tokens - start)]


class MatcherCache:
    """The matchers of the sequences a proposer drafts for, kept in step with each sequence's tokens."""

    def __init__(self, stats: ContinuationStats | None = None) -> None:
        self.stats = stats  # given to every matcher made here
        self._matchers: dict[str, tuple[SequenceMatcher, int]] = {}  # seq_id -> (matcher, its prompt length)

    def matcher(self, seq_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> SequenceMatcher:
        """seq_id's matcher extended to prompt + output. Rebuilt when the tokens are not a continuation of what it
        indexed (a reused seq_id, another prompt), as far as a constant-time check tells: the prompt's length and first
        token, and the last token indexed (a sequence's tokens only grow, so the engine never hits this)."""
        entry = self._matchers.get(seq_id)
        p = len(prompt_token_ids)
        total = p + len(output_token_ids)
        if entry is not None:
            m, prompt_len = entry
            last = m.num_tokens - 1
            if (prompt_len != p or m.num_tokens > total or last < 0 or (p and int(m.tokens[0]) != prompt_token_ids[0])
                    or int(m.tokens[last]) != (prompt_token_ids[last] if last < p else output_token_ids[last - p])):
                entry = None
        if entry is None:
            m = SequenceMatcher(self.stats)
            m.extend(prompt_token_ids)
            self._matchers[seq_id] = (m, p)
        if m.num_tokens < total:
            m.extend(output_token_ids[m.num_tokens - p :])
        return m

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            self._matchers.pop(sid, None)

    def __len__(self) -> int:
        return len(self._matchers)
