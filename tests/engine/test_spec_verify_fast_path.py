"""The verify step's host-side fast paths (engine/spec_step.py `_take_rows`, sampling/rejection.py `_Targets`):
the same rows and the same accepted tokens as the general paths, on random logits of odd sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm import SamplingParams
from pagellm.engine.spec_step import _take_rows
from pagellm.sampling import Sampler, SamplingRow, build_sampling_metadata, expand_rows_for_verify


@pytest.mark.parametrize("width", [37, 40_003])  # one piece / several pieces with a ragged last one (COPY_PIECE)
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [3, 4, 5], [2], [0, 2, 3], [5, 1, 2], [4, 3], [], [6, 0] * 20])
def test_take_rows_equals_indexing(rows, width):
    logits = torch.randn(7, width).to(torch.bfloat16)
    idx = np.asarray(rows, dtype=np.int64)
    got = _take_rows(logits, idx)  # [6, 0] * 20: 40 rows, above SERIAL_GATHER_MAX_ROWS: the gather
    assert got.shape == (len(rows), width)
    assert torch.equal(got, logits[torch.as_tensor(idx, dtype=torch.long)])


@pytest.mark.parametrize("seed", range(6))
def test_split_spec_rows_small_batches_equal_the_numpy_split(seed, monkeypatch):
    """split_spec_rows' Python walk over a few rows gives the numpy split's arrays and drafts (random mixes of
    plain rows, spec rows and rows that sample nothing)."""
    from types import SimpleNamespace

    import pagellm.spec_decode.batch as B

    rng = np.random.default_rng(seed)
    num_rows = int(rng.integers(1, 12))
    do_sample = rng.random(num_rows) < 0.8
    num_drafts = np.where(do_sample & (rng.random(num_rows) < 0.6), rng.integers(1, 8, num_rows), 0).astype(np.int32)
    sched_out = SimpleNamespace(do_sample=do_sample, num_draft_tokens=num_drafts,
                                draft_token_ids=rng.integers(0, 1000, int(num_drafts.sum())).astype(np.int64))
    small = B.split_spec_rows(sched_out)
    monkeypatch.setattr(B, "SMALL_BATCH_ROWS", 0)
    full = B.split_spec_rows(sched_out)
    for name in ("plain_rows", "plain_logit_rows", "spec_rows", "spec_logit_rows"):
        a, b = getattr(small, name), getattr(full, name)
        assert a.dtype == np.int64 and a.tolist() == b.tolist(), name
    assert small.draft_token_ids == full.draft_token_ids


@pytest.mark.parametrize("positions", [[0], [3], [2, 3, 4, 5], [0, 2, 5], [6, 1], list(range(9))])
def test_take_positions_equals_indexing(positions):
    from pagellm.engine.model_runner import _take_positions

    hidden = torch.randn(9, 41).to(torch.bfloat16)
    idx = np.asarray(positions, dtype=np.int64)
    got = _take_positions(hidden, idx, torch.from_numpy)
    assert torch.equal(got, hidden[torch.as_tensor(idx)]) and got.is_contiguous()


def _verify(logits, drafts, params):
    rows = [SamplingRow(p, [1, 2], [3], None) for p in params]
    md = build_sampling_metadata(expand_rows_for_verify(rows, drafts), logits.shape[1])
    return Sampler().verify(logits, drafts, md)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_fast_path_matches_float32_verification(dtype):
    """All-greedy rows without processors or logprobs take the argmax of the model-dtype logits: the accepted
    tokens equal those of the float32 logits (a row's drafts: its argmax, with one wrong token at a random place)."""
    gen = torch.Generator().manual_seed(0)
    vocab, ks = 1031, [3, 0, 5, 1, 7]
    logits = (torch.randn(sum(k + 1 for k in ks), vocab, generator=gen) * 3).to(dtype)
    logits[0, :] = 0.0  # a full tie: the first index wins on both paths
    target = logits.float().argmax(dim=-1).tolist()
    drafts, start = [], 0
    for i, k in enumerate(ks):
        row = target[start : start + k]
        if k and i % 2:
            j = int(torch.randint(k, (1,), generator=gen))
            row[j] = (row[j] + 1) % vocab
        drafts.append(row)
        start += k + 1
    greedy = SamplingParams(temperature=0.0)
    fast = _verify(logits, drafts, [greedy] * len(ks))
    # logprobs force the float32 path (the same argmax, logprobs besides)
    slow = _verify(logits, drafts, [SamplingParams(temperature=0.0, logprobs=1)] * len(ks))
    assert fast.accepted_token_ids == slow.accepted_token_ids
    assert fast.logprobs is None and slow.logprobs is not None
    start = 0
    for k, row, accepted in zip(ks, drafts, fast.accepted_token_ids):  # the longest matching prefix + target's token
        n = next((j for j in range(k) if row[j] != target[start + j]), k)
        assert accepted == row[:n] + [target[start + n]]
        start += k + 1
