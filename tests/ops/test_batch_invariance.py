"""Batch invariance of the CPU ops a bf16 or fp32 decoder layer runs: a row's output bits do not depend on how many
other rows share the call or where the row sits (what makes speculative verify rows of 1 + k tokens, and a
sequence inside any batch, give exactly the bits of a plain single-token decode).

Each op is compared against itself run on the row alone (the reference is the op's own single-row result:
the property is about bits, not accuracy; accuracy against pagellm.ops.reference is tested elsewhere)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

import pagellm.ops as ops  # noqa: E402
from pagellm.ops import linear_dispatch, reference  # noqa: E402

from ops.op_helpers import DEVICES  # noqa: E402

OP = torch.ops.pagellm
ROW_COUNTS = (1, 2, 3, 5, 8, 16, 17, 32, 64, 65, 150)


def _rand(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _rows_alone(fn, x):
    """fn applied to each row of x on its own, stacked."""
    return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])


def _assert_rows_invariant(fn, x):
    """fn over any slice x[j : j + M] equals fn's single-row results bit for bit."""
    alone = _rows_alone(fn, x)
    for m in ROW_COUNTS:
        for j in (0, 7):
            if j + m <= x.shape[0]:
                assert torch.equal(fn(x[j : j + m]), alone[j : j + m]), f"rows {j}..{j + m}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [64, 200])  # 200: a K tail (masked loads)
def test_linear_small_m_rows_do_not_depend_on_m(dtype, k):
    w, b = _rand(37, k, dtype=dtype, seed=1, scale=0.1), _rand(37, dtype=dtype, seed=2)

    def fn(x):
        out = torch.empty(x.shape[0], 37, dtype=dtype)
        OP.linear_small_m(out, x, w, b)
        return out

    _assert_rows_invariant(fn, _rand(160, k, dtype=dtype))


# K tails (1000 % 32 = 8, 33: one element, 84 % 32 = 20: a partial quarter then empty ones); N % 4 and N % 2 edges
@pytest.mark.parametrize("k,n", [(576, 70), (1000, 37), (33, 130), (84, 19)])
def test_linear_small_m_gemm_rows_equal_the_one_row_kernel(k, n):
    """bf16 from 8 rows on takes the GEMM schedule (linear_cpu_gemm.h): every row must still have the one-row
    kernel's bits, at every M. AVX-512: 12-, 8- and 4-row quad tiles (linear_cpu_gemm_quad.h) over 2 weight rows
    (16, 28, 64 rows: 8-row tiles for a remainder of one quad), M % 4 = 1..3 rows and an odd last weight row on
    the 6 x 4 path; AVX2: 6-, 4-, 2-row tiles and one-row edges
    (M % 6 = 0..5, 8 = 4 + 4). Several x blocks: 120 rows at K = 1000 (128, 129, 130: a last block of 8-10 rows),
    216 at K = 576; weight blocks of 32 rows (quad) or 16 (AVX2); a bias and strided x."""
    w, b = _rand(n, k, seed=1, scale=0.1), _rand(n, seed=2)
    x = _rand(260, k + 16, seed=3)[:, 8 : 8 + k]  # row stride > K

    def fn(rows):
        out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
        OP.linear_small_m(out, rows, w, b)
        return out

    alone = _rows_alone(fn, x)
    for m in (8, 9, 10, 11, 12, 13, 14, 15, 16, 20, 23, 28, 64, 67, 128, 129, 130, 200, 250):
        for j in (0, 5):
            if j + m <= x.shape[0]:
                assert torch.equal(fn(x[j : j + m]), alone[j : j + m]), f"rows {j}..{j + m}"
    no_bias = torch.empty(70, n, dtype=torch.bfloat16)
    OP.linear_small_m(no_bias, x[:70], w, None)
    assert torch.equal(no_bias, torch.cat([_one_call_no_bias(x[i : i + 1], w) for i in range(70)]))


# K: 31 (one partial chunk), 200 (a chunk tail of 8: partial quarters), 1000, 1536 (down's K: 4 packed quads fill
# L1); N: 1, 5, 23, 70 and 49 (the 1-quad tiles' 4 weight rows, the 2- and 4-quad tiles' 3, the 3-quad tiles' 2,
# each with single-row leftovers), 101 (several 24-row blocks) and 1000 at K = 576 (chunks of blocks on both threads)
@pytest.mark.parametrize("k,n", [(31, 23), (200, 5), (1000, 49), (1536, 70), (576, 1), (96, 101), (576, 1000)])
def test_linear_small_m_few_rows_equal_the_one_row_kernel(k, n):
    """bf16 at 2-16 rows (verify rows; AVX-512: linear_cpu_few_rows.h: one quad row by row at 2-4 rows, x as it is
    row by row at 5-10 (9-10 only at K <= 768), quad tiles above): every M from 2 to 17 (17: the GEMM schedule next
    door), every row the one-row kernel's bits, with and without bias, strided x at an odd offset."""
    w, b = _rand(n, k, seed=11, scale=0.1), _rand(n, seed=12)
    x = _rand(40, k + 24, seed=13)[:, 7 : 7 + k]  # row stride > K, rows not 64-byte aligned
    for bias in (b, None):

        def fn(rows):
            out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
            OP.linear_small_m(out, rows, w, bias)
            return out

        alone = _rows_alone(fn, x[:20])
        for m in range(2, 18):
            for j in (0, 3):
                assert torch.equal(fn(x[j : j + m]), alone[j : j + m]), f"rows {j}..{j + m}, bias {bias is not None}"


def _one_call_no_bias(rows, w):
    out = torch.empty(rows.shape[0], w.shape[0], dtype=torch.bfloat16)
    OP.linear_small_m(out, rows, w, None)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_dispatch_is_batch_invariant(dtype):
    if linear_dispatch._AMX_OK and dtype is torch.bfloat16:
        pytest.skip("with AMX, rows 3-256 take AMX tiles whose rounding differs from linear_small_m's (still to do)")
    w, b = _rand(48, 320, dtype=dtype, seed=3, scale=0.1), _rand(48, dtype=dtype, seed=5)
    x = _rand(300, 320, dtype=dtype, seed=4)
    for bias in (None, b):
        alone = _rows_alone(lambda r: linear_dispatch.linear(r, w, bias), x)
        for m in (5, 17, 64, 300):  # verify rows, a batch of them, a prefill chunk
            assert torch.equal(linear_dispatch.linear(x[:m], w, bias), alone[:m])
        # a [batch, seq, hidden] input (the 3-D path) gives the same rows
        assert torch.equal(linear_dispatch.linear(x[:60].view(4, 15, 320), w, bias).view(60, 48), alone[:60])


def test_norm_rotary_silu_rows_do_not_depend_on_m():
    h = 96
    weight = _rand(h, seed=5)
    x = _rand(160, h, seed=6)

    def norm(r):
        out = torch.empty_like(r)
        ops.rms_norm(out, r, weight, 1e-5)
        return out

    def add_norm(r):
        inp, res = r.clone(), (r * 0.5).contiguous()
        ops.fused_add_rms_norm(inp, res, weight, 1e-5)
        return torch.cat([inp, res], dim=1)

    def silu(r):
        out = torch.empty(r.shape[0], h // 2, dtype=r.dtype)
        ops.silu_and_mul(out, r)
        return out

    for fn in (norm, add_norm, silu):
        _assert_rows_invariant(fn, x)
    head, rot = 32, 32
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(512).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.bfloat16)
    positions = torch.randint(0, 512, (160,), generator=torch.Generator().manual_seed(7))
    qk = _rand(160, 2 * head * 3, seed=8)  # 4 query heads | 2 key heads

    def rope(r, pos):
        q, k = r[:, : 4 * head].clone(), r[:, 4 * head :].clone()
        ops.rotary_embedding(pos, q, k, head, cache, True)
        return torch.cat([q, k], dim=1)

    alone = torch.cat([rope(qk[i : i + 1], positions[i : i + 1]) for i in range(160)])
    for m in ROW_COUNTS:
        assert torch.equal(rope(qk[:m], positions[:m]), alone[:m])


def _paged_cache(lens, num_kv_heads=2, head_dim=64, block_size=16, seed=9):
    """A bf16 paged cache holding random K/V for sequences of `lens` tokens, blocks shuffled."""
    blocks = [(n + block_size - 1) // block_size for n in lens]
    total = sum(blocks)
    shape = (total, num_kv_heads, block_size, head_dim)
    kc, vc = _rand(*shape, seed=seed), _rand(*shape, seed=seed + 1)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks):
        tables[s, :nb] = perm[used : used + nb]
        used += nb
    return kc, vc, tables


def _decode(q, kc, vc, tables, lens):
    out = torch.empty_like(q)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=q.device)
    OP.paged_attention_decode(out, q, kc, vc, tables, seq_lens, 0.125, -1, 0.0)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads", [2, 8])  # MHA and GQA (4 query heads per kv head)
def test_decode_attention_does_not_depend_on_the_batch(num_heads, device):
    """Alone, in a batch, in a batch 40 times as large, and with a block table only as wide as its own blocks: the
    same bits. On CUDA the batch sets the grid (CTAs per split, decode_split_ctas) and the table width the scratch's
    split capacity; the splits themselves follow a sequence's own length (64-token grain, more than 64 splits'
    worth of keys past 4096: the 4100-key row)."""
    lens = [600, 1, 33, 257, 1000, 4100, 64, 65]  # several splits / partitions, one key, a partial tile, ...
    kc, vc, tables = (t.to(device) for t in _paged_cache(lens))
    q = _rand(len(lens), num_heads, 64, seed=11).to(device)
    together = _decode(q, kc, vc, tables, lens)
    many = _decode(q.repeat(40, 1, 1), kc, vc, tables.repeat(40, 1), lens * 40)
    for s, n in enumerate(lens):
        alone = _decode(q[s : s + 1], kc, vc, tables[s : s + 1], [n])
        narrow = _decode(q[s : s + 1], kc, vc, tables[s : s + 1, : (n + 15) // 16], [n])
        assert torch.equal(together[s], alone[0]), f"sequence {s} ({n} keys)"
        assert torch.equal(narrow[0], alone[0]), f"sequence {s} ({n} keys), narrow table"
        assert torch.equal(many[s + len(lens) * 39], alone[0]), f"sequence {s} ({n} keys), 320 rows"


def test_multi_query_decode_equals_single_token_decodes():
    """A verify row of 1 + k tokens at positions p..p+k, as the cpu backend runs it (one query per token, the
    row's block table repeated, context p + i + 1), equals plain decodes of each position."""
    lens = [300, 40]
    kc, vc, tables = _paged_cache(lens)
    q = _rand(5, 8, 64, seed=12)
    ctx = [296, 297, 298, 299, 300]  # positions 295..299 of sequence 0
    row = _decode(q, kc, vc, tables[[0] * 5], ctx)
    for i, n in enumerate(ctx):
        assert torch.equal(row[i], _decode(q[i : i + 1], kc, vc, tables[:1], [n])[0])


def _row_queries(lens_of_rows, num_heads, seed):
    """The multi-query decode arguments of rows of 1 + k tokens (one query per token: its row's block table, context
    up to its own position), as the cpu backend builds them: (row per query, context per query)."""
    rows, ctx = [], []
    for r, (end, count) in enumerate(lens_of_rows):
        rows += [r] * count
        ctx += list(range(end - count + 1, end + 1))
    return rows, ctx


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 80), (2, 2, 64), (16, 1, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_verify_rows_equal_single_token_decodes(num_heads, num_kv_heads, head_dim, dtype):
    """Runs of consecutive queries of one row share their key tiles (decode_runs_cpu_kernels.h): each query must
    still get the bits of its plain single-token decode: rows of 13 and 17 tokens (longer than one run of 16 heads'
    worth: split into runs), rows straddling the 256-key partitions and tile edges, a one-token row between them, a
    one-key context, at G = 3, 4, 1, 16 query heads per kv head."""
    spec = [(262, 13), (40, 1), (300, 17), (33, 2), (1, 1), (520, 9)]  # (last context, tokens) per row
    kc, vc, tables = _paged_cache([end for end, _ in spec], num_kv_heads=num_kv_heads, head_dim=head_dim)
    kc, vc = kc.to(dtype), vc.to(dtype)
    rows, ctx = _row_queries(spec, num_heads, seed=5)
    q = _rand(len(ctx), num_heads, head_dim, dtype=dtype, seed=13)
    out = torch.empty_like(q)
    OP.paged_attention_decode(out, q, kc, vc, tables[rows], torch.tensor(ctx, dtype=torch.int32), 0.125, -1, 0.0)
    for i, n in enumerate(ctx):
        alone = torch.empty_like(q[i : i + 1])
        OP.paged_attention_decode(alone, q[i : i + 1], kc, vc, tables[rows[i] : rows[i] + 1],
                                  torch.tensor([n], dtype=torch.int32), 0.125, -1, 0.0)
        assert torch.equal(out[i], alone[0]), f"query {i} (row {rows[i]}, context {n})"
    ref = torch.empty_like(q)
    reference.paged_attention_decode(ref, q, kc, vc, tables[rows], torch.tensor(ctx, dtype=torch.int32), 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


def test_fused_verify_rows_with_softcap_and_int8_cache():
    """The fused path with a soft cap and on an int8 cache (per-row scales): bits of the single-token decodes."""
    spec = [(270, 12), (90, 5)]
    kc, vc, tables = _paged_cache([end for end, _ in spec], num_kv_heads=3, head_dim=64)
    rows, ctx = _row_queries(spec, 9, seed=6)
    q = _rand(len(ctx), 9, 64, seed=14)
    lens = torch.tensor(ctx, dtype=torch.int32)
    out = torch.empty_like(q)
    OP.paged_attention_decode(out, q, kc, vc, tables[rows], lens, 0.125, -1, 30.0)
    ks = torch.rand(kc.shape[:3], generator=torch.Generator().manual_seed(3)) * 0.02 + 0.001
    vs = torch.rand(vc.shape[:3], generator=torch.Generator().manual_seed(4)) * 0.02 + 0.001
    k8 = (kc.float() * 40).clamp(-127, 127).to(torch.int8)
    v8 = (vc.float() * 40).clamp(-127, 127).to(torch.int8)
    out8 = torch.empty_like(q)
    OP.paged_attention_decode_quantized(out8, q, k8, v8, ks, vs, tables[rows], lens, 0.125, -1, 0.0)
    for i, n in enumerate(ctx):
        one = torch.tensor([n], dtype=torch.int32)
        alone, alone8 = torch.empty_like(q[:1]), torch.empty_like(q[:1])
        OP.paged_attention_decode(alone, q[i : i + 1], kc, vc, tables[rows[i] : rows[i] + 1], one, 0.125, -1, 30.0)
        OP.paged_attention_decode_quantized(alone8, q[i : i + 1], k8, v8, ks, vs, tables[rows[i] : rows[i] + 1], one,
                                            0.125, -1, 0.0)
        assert torch.equal(out[i], alone[0]) and torch.equal(out8[i], alone8[0]), f"query {i}"


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (8, 1, 128, 32), (4, 4, 64, 1), (32, 4, 128, 64), (12, 3, 80, 8)])
def test_verify_rows_of_every_length_equal_single_token_decodes(num_heads, num_kv_heads, head_dim, block_size):
    """A verify row of 1 + k queries for every k in 0..15, each at its own odd context (51..1999: one to eight
    256-key partitions, partial tiles and blocks), GQA 1 / 3 / 4 / 8, head dims 64 / 80 / 128, blocks of 1-64 keys:
    every query of the row gets exactly the bits of its own one-query decode, and the row is within bf16 rounding
    of the pure-torch reference."""
    starts = [51 + 127 * k for k in range(16)]  # the first query's context per k: odd, up to 1956 + 15
    kc, vc, tables = _paged_cache([2000], num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, seed=21)
    for k, start in enumerate(starts):
        ctx = list(range(start, start + k + 1))
        q = _rand(len(ctx), num_heads, head_dim, seed=100 + k)
        lens = torch.tensor(ctx, dtype=torch.int32)
        row_tables = tables[[0] * len(ctx)]
        out = torch.empty_like(q)
        OP.paged_attention_decode(out, q, kc, vc, row_tables, lens, head_dim**-0.5, -1, 0.0)
        for i, n in enumerate(ctx):
            alone = _decode_scaled(q[i : i + 1], kc, vc, tables[:1], [n], head_dim**-0.5)
            assert torch.equal(out[i], alone[0]), f"k={k}: query {i} (context {n})"
        ref = torch.empty_like(q)
        reference.paged_attention_decode(ref, q, kc, vc, row_tables, lens, head_dim**-0.5)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)


def _decode_scaled(q, kc, vc, tables, lens, scale):
    out = torch.empty_like(q)
    OP.paged_attention_decode(out, q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), scale, -1, 0.0)
    return out
