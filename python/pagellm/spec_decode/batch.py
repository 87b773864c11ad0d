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


def split_spec_rows(sched_out) -> SpecRows:
    """Logits rows follow SchedulerOutput.logits_indices: row by row over the sampling rows, one for a
    plain row, 1 + k for a spec row."""
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


def keep_rows(split: SpecRows, keep: np.ndarray) -> SpecRows:
    """`split` without the scheduler rows r whose keep[r] is False (rows aborted while their step was in
    flight: they get no token), logits rows and drafts dropped alike."""
    plain, spec = keep[split.plain_rows], keep[split.spec_rows]
    counts = np.asarray([1 + len(d) for d in split.draft_token_ids], dtype=np.int64)
    return SpecRows(split.plain_rows[plain], split.plain_logit_rows[plain], split.spec_rows[spec],
                    split.spec_logit_rows[np.repeat(spec, counts)],
                    [d for d, k in zip(split.draft_token_ids, spec) if k])
