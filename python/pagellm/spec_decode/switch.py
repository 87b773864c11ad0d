"""When drafting pays: per request, from its recent acceptance and the measured cost of verifying.

A decode step of n rows emits n tokens in `plain_s(n)` seconds, so one token is worth `plain_s(n) / n`.
A request's k drafts make the step longer by `k * extra_s` (the verify's extra tokens through the forward,
measured as spec-step time minus plain-step time per draft token) plus its share of the proposer's time,
and return on average `accepted` more tokens (an EWMA of its recent verifies). The request drafts while

    (accepted - 0.1) * plain_s(n) / n  >  k * extra_s + proposer_s / num_proposed

(accepted: an EWMA of weight `decay`, the proposer's `acceptance_decay`: 0.3 by default, 0.03 for Medusa / Hydra heads,
whose per-verify counts are noise around a steady mean; k: the request's recent mean number of drafts per verify, an
EWMA: a proposer whose draft length follows
the match, ngram's default, often drafts fewer than num_speculative_tokens) and not otherwise, re-probing every `probe_every` steps so that a request whose text turns repetitive gets
its drafts back (a request whose re-probes keep failing waits up to 8x longer). At batch 1 this is "tokens
per verify (1 + accepted) over the verify's cost relative to a plain step (1 + k * extra_s / plain_s) above
1" (less a 0.1-token margin); at larger batches one token is cheaper, so the same drafts
must be accepted more often to pay, which switches speculation off where it cannot pay at that size.

How many drafts (adaptive k, `num_drafts`; speculative_config `adaptive_k`, opt-in): each verify of n drafts is
n Bernoulli trials cut at the first rejection, so a request's per-draft acceptance rate a is estimated as
EWMA(accepted) / EWMA(accepted + rejected);
with a, the next n drafts return a (1 - a^n) / (1 - a) tokens on average, and the request asks for the n <= k that
maximises its tokens per second, (1 + that) / (plain_s(n) / n + n * (extra_s + proposer_s per draft token)). Copying
text (a near 1) gets all k drafts, a request whose drafts often miss gets 1 or 2: k can be set high for copy-heavy
work without paying k per verify everywhere.

Until a cost is measured every request drafts (the second timed step at a batch size runs without drafts
to measure plain_s(n)); the verify cost counts once MIN_COST_SAMPLES spec steps measured it. Steps with waiting or
prefilling requests, steps that held a one-time cost (`discard_step`: a step graph's first sightings), and steps more
than IDLE_FACTOR times slower than expected (the engine sat idle between steps; until the verify cost is measured a
draft token is expected to cost up to a plain step) are not timed: one such sample used to switch a request off for hundreds of steps (a graph capture
timed as a verify, session 12's ngram at 1.13x). Outputs never depend on this: it only decides who gets drafts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Callable

WINDOW = 9  # timing samples kept per kind (median: robust to a noisy shared machine)
IDLE_FACTOR = 4.0  # a step this many times the median plain step is not timed (the engine idled)
# a request whose re-probes keep failing waits probe_every, then 2x, 4x, 8x as long before the next one
MAX_BACKOFF_DOUBLINGS = 3
# drafts must win at least this many tokens per verify beyond their cost: where a verify costs next to nothing
# (a tiny model, timer noise) an acceptance decaying towards 0 would otherwise never switch off
MIN_NET_TOKENS = 0.1
MAX_DRAFT_RATE = 0.98  # the per-draft acceptance estimate is capped below 1: one miss must still shorten the drafts
# spec steps timed before their verify cost may switch a request off: the median of 3 outlives one odd sample, while
# off a request is timed only on its rare re-probes, so a wrong first verdict would stand for hundreds of steps
MIN_COST_SAMPLES = 3


class _Window:
    """The last WINDOW samples of one kind and their median, cached until the next sample: a served step asks for
    the same few medians ~10 times (each `statistics.median` a sort and a dozen Python calls, run cold after the
    forward)."""

    __slots__ = ("_samples", "_median")

    def __init__(self) -> None:
        self._samples: deque = deque(maxlen=WINDOW)
        self._median: float | None = None

    def append(self, sample: float) -> None:
        self._samples.append(sample)
        self._median = None

    def median(self) -> float:
        if self._median is None:
            self._median = median(self._samples)
        return self._median

    def __len__(self) -> int:
        return len(self._samples)

    def __iter__(self):
        return iter(self._samples)


@dataclass
class _StepInFlight:
    start_s: float
    num_rows: int
    num_draft_tokens: int = 0
    proposer_s: float = 0.0
    num_proposed: int = 0


class SpecSwitch:
    """Per-request on/off of speculation from acceptance and measured step costs (see the module doc)."""

    def __init__(self, num_speculative_tokens: int, probe_every: int = 16, decay: float = 0.3,
                 initial_acceptance: float | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        if not isinstance(probe_every, int) or probe_every < 2:
            raise ValueError(f"probe_every must be an integer >= 2, got {probe_every!r}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.k = num_speculative_tokens
        self.clock = clock  # seconds; every time the switch compares comes from it (tests pass a fake one)
        self.probe_every = probe_every
        self.decay = decay
        # a new request starts from the acceptance of recent verifies of any request (the same kind of text,
        # usually), before the first verify from this optimistic guess
        self.initial_acceptance = num_speculative_tokens / 2 if initial_acceptance is None else initial_acceptance
        self._pool_accepted = self.initial_acceptance
        self._accepted: dict[str, float] = {}  # seq_id -> EWMA of accepted drafts per verify
        # seq_id -> EWMAs of (accepted drafts, drafts judged: accepted + the rejected one) per verify: adaptive k
        self._trials: dict[str, tuple[float, float]] = {}
        self._drafts: dict[str, float] = {}  # seq_id -> EWMA of drafts per verify (what its drafting costs)
        self._steps_off: dict[str, int] = {}  # seq_id -> steps since it last drafted while switched off
        self._num_reprobes: dict[str, int] = {}  # seq_id -> re-probes since it was last on (backs the probes off)
        self._num_timed: dict[int, int] = {}  # num rows -> timed steps seen
        self._plain_s: dict[int, _Window] = {}  # num rows -> seconds of recent draft-free decode steps
        self._extra_s: dict[int, _Window] = {}  # num rows -> seconds per draft token a spec step adds
        self._proposer_s = _Window()  # proposer seconds per request asked
        self._proposer_draft_s = _Window()  # proposer seconds per draft token (a draft model's steps)
        self._step: _StepInFlight | None = None
        self.num_switched_off = 0  # request-steps without drafts because they did not pay (stats, tests)

    def begin_step(self, ready_seq_ids: list[str], timed: bool) -> bool:
        """A step starts with these decode-ready sequences: close the previous step's timing, forget
        sequences that left. `timed`: only decode-ready rows in this step. Returns False when this step
        runs without drafts to measure a plain step at this batch size."""
        now_s = self.clock()
        self._close_step(now_s)
        n = len(ready_seq_ids)
        live = set(ready_seq_ids)
        for table in (self._accepted, self._trials, self._drafts, self._steps_off, self._num_reprobes):
            for sid in [s for s in table if s not in live]:
                del table[sid]
        self._step = None
        if not (timed and n):
            return True
        self._step = _StepInFlight(now_s, n)
        seen = self._num_timed[n] = self._num_timed.get(n, 0) + 1
        # no plain time at this size yet: the second timed step (the first may hold one-time costs) goes plain
        return not (n not in self._plain_s and seen % self.probe_every == 2)

    def num_drafts(self, seq_id: str, num_rows: int) -> int:
        """How many drafts (1 .. k) this sequence should ask for in a step of num_rows rows (module doc); k until its
        first verify or while the costs at this batch size are unmeasured."""
        plain, extra, trials = self._plain_s.get(num_rows), self._extra_s.get(num_rows), self._trials.get(seq_id)
        if not plain or not extra or len(extra) < MIN_COST_SAMPLES or trials is None or trials[1] <= 0.0:
            return self.k
        rate = min(trials[0] / trials[1], MAX_DRAFT_RATE)
        # the proposer's time counts per draft: a draft model runs one forward per draft (ngram's is ~nothing)
        token_s = plain.median() / num_rows
        extra_s = extra.median() + (self._proposer_draft_s.median() if self._proposer_draft_s else 0.0)

        def tokens_per_s(n: int) -> float:
            return (1.0 + rate * (1.0 - rate**n) / (1.0 - rate)) / (token_s + n * extra_s)

        return max(range(1, self.k + 1), key=tokens_per_s)  # the smallest n among equals

    def draft_token_cost(self, num_rows: int) -> float | None:
        """A draft token's cost (verify + proposer) relative to one row's share of a plain step of num_rows rows, as
        measured (None until MIN_COST_SAMPLES spec steps were timed): what a proposer sizing its drafts reads."""
        plain, extra = self._plain_s.get(num_rows), self._extra_s.get(num_rows)
        if not plain or not extra or len(extra) < MIN_COST_SAMPLES or plain.median() <= 0.0:
            return None
        draft_s = extra.median() + (self._proposer_draft_s.median() if self._proposer_draft_s else 0.0)
        return draft_s / (plain.median() / num_rows)

    def wants_drafts(self, seq_id: str, num_rows: int, num_drafts: int | None = None) -> bool:
        """Whether this sequence should draft (num_drafts of them; default: its recent mean per verify, k before its
        first verify) in a step of num_rows decode-ready rows."""
        if num_drafts is None:
            num_drafts = self._drafts.get(seq_id, self.k)
        cost = self._draft_cost_s(num_rows, num_drafts)
        plain = self._plain_s.get(num_rows)
        if cost is None or not plain:
            return True
        token_s = plain.median() / num_rows
        if (self.acceptance(seq_id) - MIN_NET_TOKENS) * token_s > cost:
            self._steps_off.pop(seq_id, None)
            self._num_reprobes.pop(seq_id, None)
            return True
        off = self._steps_off[seq_id] = self._steps_off.get(seq_id, 0) + 1
        reprobes = self._num_reprobes.get(seq_id, 0)
        if off >= self.probe_every << min(reprobes, MAX_BACKOFF_DOUBLINGS):  # a verify refreshes its acceptance
            self._steps_off[seq_id] = 0
            self._num_reprobes[seq_id] = reprobes + 1
            return True
        self.num_switched_off += 1
        return False

    def discard_step(self) -> None:
        """The step in flight held a one-time cost (e.g. a step graph's first sightings or capture): not timed, and
        not counted as timed (a discarded plain-step probe is repeated by the next step)."""
        if self._step is not None:
            self._num_timed[self._step.num_rows] -= 1
        self._step = None

    def record_proposals(self, num_draft_tokens: int, proposer_s: float, num_proposed: int) -> None:
        """What this step's proposer call produced and cost."""
        if self._step is not None:
            self._step.num_draft_tokens += num_draft_tokens
            self._step.proposer_s += proposer_s
            self._step.num_proposed += num_proposed

    def record_verify(self, seq_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verified spec row of this sequence."""
        if num_drafts <= 0:
            return
        prev = self.acceptance(seq_id)
        self._accepted[seq_id] = prev + self.decay * (num_accepted - prev)
        drafts = self._drafts.get(seq_id, float(num_drafts))
        self._drafts[seq_id] = drafts + self.decay * (num_drafts - drafts)
        judged = num_accepted + (num_accepted < num_drafts)  # the trials up to and including the first rejection
        ok, n = self._trials.get(seq_id, (float(num_accepted), float(judged)))
        self._trials[seq_id] = (ok + self.decay * (num_accepted - ok), n + self.decay * (judged - n))
        self._pool_accepted += self.decay * (num_accepted - self._pool_accepted)

    def acceptance(self, seq_id: str) -> float:
        """The sequence's current EWMA of accepted drafts per verify."""
        return self._accepted.get(seq_id, self._pool_accepted)

    def _draft_cost_s(self, num_rows: int, num_drafts: float) -> float | None:
        """Seconds num_drafts drafts add to a step of num_rows rows (verify + the proposer's share), None until
        measured."""
        extra = self._extra_s.get(num_rows)
        if not extra or len(extra) < MIN_COST_SAMPLES:
            return None
        proposer = self._proposer_s.median() if self._proposer_s else 0.0
        return num_drafts * extra.median() + proposer

    def _close_step(self, now_s: float) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        elapsed = now_s - step.start_s
        plain = self._plain_s.get(step.num_rows)
        extra = self._extra_s.setdefault(step.num_rows, _Window())
        if plain:  # a draft token costs at most a plain step's time until measured (compute-bound: the whole step)
            per_draft = extra.median() if extra else plain.median()
            if elapsed > IDLE_FACTOR * (plain.median() + step.num_draft_tokens * per_draft + step.proposer_s):
                return
        if step.num_proposed:
            self._proposer_s.append(step.proposer_s / step.num_proposed)
        if step.num_draft_tokens:
            self._proposer_draft_s.append(step.proposer_s / step.num_draft_tokens)
        if step.num_draft_tokens == 0:
            self._plain_s.setdefault(step.num_rows, _Window()).append(elapsed - step.proposer_s)
        elif plain:
            extra.append(max((elapsed - step.proposer_s - plain.median()) / step.num_draft_tokens, 0.0))
