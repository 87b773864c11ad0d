"""PAGELLM_CUDA_DECODE_SPLIT_GRAIN (the flash-decoding rule's fewest tokens per split, a sweep knob of
tools/gpu/profile_step.py) on CUDA: every grain against the reference, a row's bits independent of the batch at a
given grain, and a bad value refused before any launch."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm import ops
from pagellm.ops import reference as ref
from ops.op_helpers import assert_close, poison, random_block_tables, random_caches, requires_ops

pytestmark = [requires_ops, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _case(seq_lens, num_heads=16, num_kv_heads=4, head_dim=128, block_size=16, dtype=torch.bfloat16):
    tables, num_blocks = random_block_tables(seq_lens, block_size, seed=len(seq_lens))
    kc, vc = random_caches(num_blocks, num_kv_heads, block_size, head_dim, dtype, "cuda", seed=head_dim)
    g = torch.Generator().manual_seed(3)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype).cuda()
    return query, kc, vc, tables.cuda(), torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("grain", ["16", "32", "128", "256", "1000"])
def test_decode_split_grain_matches_reference(monkeypatch, grain):
    monkeypatch.setenv("PAGELLM_CUDA_DECODE_SPLIT_GRAIN", grain)
    seq_lens = [190, 1, 17, 1000, 4000, 255, 256, 257]  # one split and many, at every grain
    query, kc, vc, tables, lens = _case(seq_lens)
    scale = 1.0 / math.sqrt(query.shape[-1])
    out, expected = poison(torch.empty_like(query)), torch.empty_like(query)
    ops.paged_attention_decode(out, query, kc, vc, tables, lens, scale, -1, 0.0)
    ref.paged_attention_decode(expected, query, kc, vc, tables, lens, scale, -1, 0.0)
    assert_close(out, expected)
    for i in range(len(seq_lens)):  # each row alone: the same bits (the split rule reads the row's own length)
        alone = torch.empty_like(query[i : i + 1])
        ops.paged_attention_decode(alone, query[i : i + 1], kc, vc, tables[i : i + 1], lens[i : i + 1], scale, -1, 0.0)
        assert torch.equal(alone, out[i : i + 1]), i


@pytest.mark.parametrize("bad", ["8", "abc", "64x", "100000"])
def test_decode_split_grain_refuses_bad_values(monkeypatch, bad):
    monkeypatch.setenv("PAGELLM_CUDA_DECODE_SPLIT_GRAIN", bad)
    query, kc, vc, tables, lens = _case([40])
    out = poison(torch.empty_like(query))
    with pytest.raises(RuntimeError, match="PAGELLM_CUDA_DECODE_SPLIT_GRAIN must be an integer in"):
        ops.paged_attention_decode(out, query, kc, vc, tables, lens, 0.1, -1, 0.0)
    assert torch.isnan(out).all()  # nothing launched
