"""How many n-gram drafts pay (`"draft_length": "cost"`, ngram.py): per request and step, the number of drafts that
maximises expected tokens per unit of step time.

A followed match that has agreed with the text for L tokens goes on agreeing for one more with a probability p(L)
that grows with L (a 1-token coincidence rarely goes on, a 30-token copy run usually does). The matchers see every
accepted token, so they record, per agreed length, whether the match went on (`ContinuationStats`, pooled over the
proposer's requests, recent outcomes weighing most). Drafting d tokens after a match of length L then returns

    E(d) = sum over i = 1..d of p(L) p(L + 1) ... p(L + i - 1)

accepted drafts on average (greedy verification accepts a prefix), in a step whose row costs 1 + c d plain-step
token times (c: a draft token's verify cost relative to one row's share of a plain step, measured by SpecSwitch or
given as `draft_token_cost`). `best_draft_length` picks the d in 0..k with the most (1 + E(d)) / (1 + c d): long
drafts where the match has held, short ones after a coincidence, none where even one draft does not pay.
"""

from __future__ import annotations

import numpy as np

NUM_EXACT = 16  # agreed lengths 1..16 each have their own estimate; longer ones share doubling ranges
NUM_BUCKETS = NUM_EXACT + 5  # 17-32, 33-64, 65-128, 129-256, longer
PRIOR_WEIGHT = 4.0  # pseudo-outcomes of the prior p0(L) = L / (L + 1) per bucket: data outweighs it within a few steps
MAX_BUCKET_WEIGHT = 512.0  # a bucket's outcomes are halved past this: the estimate follows the current text


def length_bucket(length: int) -> int:
    if length <= NUM_EXACT:
        return max(length, 1) - 1
    return min(NUM_EXACT + (length - 1).bit_length() - 5, NUM_BUCKETS - 1)


_BUCKET_LENGTHS = [float(i + 1) for i in range(NUM_EXACT)] + [24.0, 48.0, 96.0, 192.0, 384.0]


class ContinuationStats:
    """Per agreed-length bucket: how often a followed match went on agreeing with the next token."""

    def __init__(self) -> None:
        lengths = np.asarray(_BUCKET_LENGTHS)
        self.went_on = PRIOR_WEIGHT * lengths / (lengths + 1.0)  # the prior as pseudo-outcomes
        self.seen = np.full(NUM_BUCKETS, PRIOR_WEIGHT)
        self.num_recorded = 0

    def record(self, length: int, went_on: bool) -> None:
        """A match that had agreed for `length` tokens met the sequence's next token: it agreed or not."""
        b = length_bucket(length)
        self.went_on[b] += went_on
        self.seen[b] += 1.0
        self.num_recorded += 1
        if self.seen[b] > MAX_BUCKET_WEIGHT:
            self.went_on[b] *= 0.5
            self.seen[b] *= 0.5

    def probability(self, length: int) -> float:
        """Estimated chance that a match agreed for `length` tokens agrees with the next one."""
        b = length_bucket(length)
        return float(self.went_on[b] / self.seen[b])


def best_draft_length(stats: ContinuationStats, agreed: int, max_drafts: int, draft_token_cost: float) -> int:
    """The d in 0..max_drafts with the most expected tokens per unit of row time, (1 + E(d)) / (1 + c d) (module
    doc); 0 when agreed < 1 (no match). The smallest such d on a tie."""
    if agreed < 1 or max_drafts < 1:
        return 0
    best_d, best_rate = 0, 1.0
    survive, expected = 1.0, 0.0
    for d in range(1, max_drafts + 1):
        survive *= stats.probability(agreed + d - 1)
        expected += survive
        rate = (1.0 + expected) / (1.0 + draft_token_cost * d)
        if rate > best_rate * (1.0 + 1e-9):
            best_d, best_rate = d, rate
    return best_d
