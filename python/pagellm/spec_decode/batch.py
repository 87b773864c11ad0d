"""Where a step's spec rows sit in the SchedulerOutput and in the runner's logits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SpecRows:
    """A step's sampling rows split into plain rows (one logits row each) and spec rows (1 + k each)."""

    plain_rows: np.ndarray  # scheduler rows sampling one token
    plain_logit_rows: np.ndarray  # their logits rows
    spec_rows: np.ndarray  # scheduler rows with drafts
    spec_logit_rows: np.ndarray  # the 1 + k logits rows of each spec row, row by row
    draft_token_ids: list[list[int]]  # per spec row


SMALL_BATCH_ROWS = 16  # up to this many scheduler rows, split_spec_rows walks them in Python


def split_spec_rows(sched_out) -> SpecRows:
    """Logits rows follow SchedulerOutput.logits_indices: row by row over the sampling rows, one for a
    plain row, 1 + k for a spec row."""
    if len(sched_out.do_sample) <= SMALL_BATCH_ROWS:
        return _split_small(sched_out)
    sampling = np.flatnonzero(sched_out.do_sample)
    k = sched_out.num_draft_tokens.astype(np.int64)
    count = 1 + k[sampling]
    start = np.cumsum(count) - count
    is_spec = k[sampling] > 0
    spec_starts, spec_counts = start[is_spec], count[is_spec]
    spec_logit_rows = np.concatenate([np.arange(s, s + n) for s, n in zip(spec_starts, spec_counts)]
                                     ) if len(spec_starts) else np.zeros(0, dtype=np.int64)
    flat = sched_out.draft_token_ids.tolist()
    bounds = np.concatenate([[0], np.cumsum(spec_counts - 1)]).tolist()
    drafts = [flat[bounds[i] : bounds[i + 1]] for i in range(len(spec_counts))]
    return SpecRows(sampling[~is_spec], start[~is_spec], sampling[is_spec], spec_logit_rows, drafts)


def _split_small(sched_out) -> SpecRows:
    """split_spec_rows over a few rows in plain Python: the same arrays without ~15 numpy calls, each slow right
    after a forward has streamed the weights through the caches (a batch-1 verify step's host path, session 18)."""
    do_sample, num_drafts = sched_out.do_sample.tolist(), sched_out.num_draft_tokens.tolist()
    flat = sched_out.draft_token_ids.tolist()
    plain, plain_logits, spec, spec_logits, drafts = [], [], [], [], []
    logit, draft = 0, 0
    for r, (sampled, k) in enumerate(zip(do_sample, num_drafts)):
        if not sampled:
            continue
        if k:
            spec.append(r)
            spec_logits.extend(range(logit, logit + 1 + k))
            drafts.append(flat[draft : draft + k])
            draft += k
        else:
            plain.append(r)
            plain_logits.append(logit)
        logit += 1 + k

    def rows(values: list[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)

    return SpecRows(rows(plain), rows(plain_logits), rows(spec), rows(spec_logits), drafts)


def keep_rows(split: SpecRows, keep: np.ndarray) -> SpecRows:
    """`split` without the scheduler rows r whose keep[r] is False (rows aborted while their step was in
    flight: they get no token), logits rows and drafts dropped alike."""
    plain, spec = keep[split.plain_rows], keep[split.spec_rows]
    counts = np.asarray([1 + len(d) for d in split.draft_token_ids], dtype=np.int64)
    return SpecRows(split.plain_rows[plain], split.plain_logit_rows[plain], split.spec_rows[spec],
                    split.spec_logit_rows[np.repeat(spec, counts)],
                    [d for d, k in zip(split.draft_token_ids, spec) if k])
