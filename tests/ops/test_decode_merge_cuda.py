"""The decode kernels' in-kernel split merge (PAGELLM_CUDA_FUSE_DECODE_REDUCE, docs/cuda.md): the last CTA of each
(sequence, kv head, head group) merges the flash-decoding splits instead of a second kernel. Against the reference
and bit for bit against the two-kernel path: dtypes, GQA groups of 1-12 heads (one and two head groups per kv head),
head dims, contexts of one split and of many (up to the 64-split cap), window and soft-cap, int8 caches, MLA's
576 / 512; launches in a row and CUDA-graph replays with new lengths (the counters are left at zero); a bad switch
value refused before any launch."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm.ops import reference as ref
from ops.op_helpers import assert_close, poison, random_block_tables, random_caches, requires_ops

pytestmark = [requires_ops, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
OP = torch.ops.pagellm
ENV = "PAGELLM_CUDA_FUSE_DECODE_REDUCE"
# one split (<= 64 tokens), a few, many, the 64-split cap (4000 tokens: 63 splits of 64), an empty context
SEQ_LENS = [190, 1, 64, 65, 17, 1000, 4000, 0, 129]


def _case(seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16, seed=0):
    tables, num_blocks = random_block_tables(seq_lens, block_size, seed=seed + len(seq_lens))
    kc, vc = random_caches(num_blocks, num_kv_heads, block_size, head_dim, dtype, "cuda", seed=seed + head_dim)
    g = torch.Generator().manual_seed(seed + 3)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype).cuda()
    return query, kc, vc, tables.cuda(), torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


def _decode(monkeypatch, merge: str, query, kc, vc, tables, lens, window=-1, softcap=0.0):
    monkeypatch.setenv(ENV, merge)
    out = poison(torch.empty_like(query))
    OP.paged_attention_decode(out, query, kc, vc, tables, lens, 1.0 / math.sqrt(query.shape[-1]), window, softcap)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (16, 4), (32, 4), (12, 1), (24, 2)])  # G = 1, 4, 8, 12 (8 + 4), 12
@pytest.mark.parametrize("head_dim", [64, 128])
def test_merge_in_kernel_matches_reduce_kernel_and_reference(monkeypatch, dtype, heads, head_dim):
    query, kc, vc, tables, lens = _case(SEQ_LENS, *heads, head_dim, dtype)
    fused = _decode(monkeypatch, "1", query, kc, vc, tables, lens)
    apart = _decode(monkeypatch, "0", query, kc, vc, tables, lens)
    assert torch.equal(fused, apart)
    expected = torch.empty_like(query)
    ref.paged_attention_decode(expected, query, kc, vc, tables, lens, 1.0 / math.sqrt(head_dim), -1, 0.0)
    assert_close(fused, expected)


@pytest.mark.parametrize("head_dim", [80, 96, 112, 256])
def test_merge_in_kernel_other_head_dims_window_softcap(monkeypatch, head_dim):
    query, kc, vc, tables, lens = _case(SEQ_LENS, 8, 2, head_dim, torch.bfloat16, seed=5)
    for window, softcap in ((-1, 0.0), (300, 0.0), (-1, 30.0)):
        fused = _decode(monkeypatch, "1", query, kc, vc, tables, lens, window, softcap)
        apart = _decode(monkeypatch, "0", query, kc, vc, tables, lens, window, softcap)
        assert torch.equal(fused, apart), (window, softcap)


def test_launches_in_a_row_leave_the_counters_at_zero(monkeypatch):
    """Each launch's last CTA resets its counter: different batches, lengths and head layouts one after another
    (a counter left non-zero would make the next launch merge early or never)."""
    for i, (seq_lens, heads) in enumerate([(SEQ_LENS, (16, 4)), ([3000, 70, 500], (32, 4)), (SEQ_LENS[::-1], (8, 8)),
                                           ([130] * 40, (16, 2)), ([4000], (4, 1))]):
        query, kc, vc, tables, lens = _case(seq_lens, *heads, 64, torch.bfloat16, seed=i)
        for _ in range(2):
            assert torch.equal(_decode(monkeypatch, "1", query, kc, vc, tables, lens),
                               _decode(monkeypatch, "0", query, kc, vc, tables, lens)), i


def test_graph_replays_with_new_lengths(monkeypatch):
    """A captured decode (merge in kernel) replayed with other seq_lens gives the two-kernel path's bits each time."""
    monkeypatch.setenv(ENV, "1")
    query, kc, vc, tables, lens = _case(SEQ_LENS, 16, 4, 64, torch.bfloat16, seed=7)
    out = torch.empty_like(query)
    scale = 0.125
    OP.paged_attention_decode(out, query, kc, vc, tables, lens, scale, -1, 0.0)  # warm-up (allocates the counters)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        OP.paged_attention_decode(out, query, kc, vc, tables, lens, scale, -1, 0.0)
    max_len = tables.shape[1] * kc.shape[2]
    g = torch.Generator().manual_seed(11)
    for _ in range(6):
        lens.copy_(torch.randint(0, min(max_len, 4000) + 1, (len(SEQ_LENS),), generator=g, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        expected = _decode(monkeypatch, "0", query, kc, vc, tables, lens)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


def test_int8_cache(monkeypatch):
    from ops.test_kv_int8 import _filled_cache

    seq_lens = [190, 5, 1000]
    tables, num_blocks = random_block_tables(seq_lens, 16, seed=2)
    cache = _filled_cache(num_blocks, 2, 16, 64, torch.int8, "cuda", seed=4)
    query = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).cuda()
    args = (*cache, tables.cuda(), torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), 0.125, -1, 0.0)
    outs = []
    for merge in ("1", "0"):
        monkeypatch.setenv(ENV, merge)
        out = poison(torch.empty_like(query))
        OP.paged_attention_decode_quantized(out, query, *args)
        outs.append(out)
    assert torch.equal(*outs)


def test_mla_576_512(monkeypatch):
    from ops.test_mla_decode import make_batch

    query, cache, tables, lens = make_batch([700, 2, 1500], 16, 576, 16, torch.bfloat16, "cuda", seed=3)
    outs = []
    for merge in ("1", "0"):
        monkeypatch.setenv(ENV, merge)
        out = poison(torch.empty(3, 16, 512, dtype=torch.bfloat16, device="cuda"))
        OP.paged_mla_decode(out, query, cache, tables, lens, 1.0 / math.sqrt(192))
        outs.append(out)
    assert torch.equal(*outs)


@pytest.mark.parametrize("bad", ["2", "yes", " 1"])
def test_bad_switch_is_refused_before_any_launch(monkeypatch, bad):
    query, kc, vc, tables, lens = _case([40], 4, 4, 64, torch.bfloat16)
    monkeypatch.setenv(ENV, bad)
    out = poison(torch.empty_like(query))
    with pytest.raises(RuntimeError, match="PAGELLM_CUDA_FUSE_DECODE_REDUCE must be 0 or 1"):
        OP.paged_attention_decode(out, query, kc, vc, tables, lens, 0.1, -1, 0.0)
    assert torch.isnan(out).all()
