"""The fused CUDA ops (ops/fused_dispatch.py, docs/cuda.md "Fused kernels") bit for bit against the two CUDA ops each
replaces, and against their pure-torch reference (ops/fused_reference.py): rotary_embedding_and_cache (neox / gptj,
partial rotary, GQA, strided views of a merged qkv row, skipped slots, positions out of range, block boundaries),
rms_norm_linear and silu_and_mul_linear (M = 1 and a few rows, K that reach every emulated norm block size, K with no
16-byte vectors and K too long for shared memory: the two-kernel fallback, odd N, bias, kernels 2-4, PDL), a PDL chain
of them replayed in a CUDA graph, and their argument errors."""

from __future__ import annotations

import pytest
import torch

from pagellm.ops import fused_reference as fref
from ops.op_helpers import assert_close, poison, requires_ops

pytestmark = [requires_ops, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
OP = torch.ops.pagellm
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape, dtype, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).cuda()


# ------------------------------------------------------------------------------------- rope + cache write
def _rope_case(T, hq, hkv, d, rot, dtype, cache_dtype, block_size=16, seed=0):
    """q / k / v as strided views of one merged [T, (hq + 2 hkv) * d + 8] row (as the qkv projection leaves them;
    odd T: one element in, so no 16-byte vectors), a cos|sin cache of 300 positions, slots over shuffled blocks with
    one -1, one position out of range."""
    width, off = (hq + 2 * hkv) * d, T % 2
    qkv = _rand(T, width + 8, dtype=dtype, seed=seed)[:, off : off + width]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    cos_sin = _rand(300, rot, dtype=cache_dtype, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    positions = torch.randint(0, 300, (T,), generator=g)
    if T > 2:
        positions[1] = 300  # out of range: left unrotated (the cache still gets the row)
    num_blocks = (T + block_size - 1) // block_size + 2
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    if T > 3:
        slots[2] = -1
    shape = (num_blocks, hkv, block_size, d)
    caches = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for _ in range(2)]
    return positions.cuda(), q, k, v, caches, slots.cuda(), cos_sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("heads", [(4, 4), (32, 4), (12, 2)])
@pytest.mark.parametrize("d,rot,neox", [(64, 64, True), (128, 128, False), (64, 32, True), (80, 40, False)])
def test_rope_and_cache_matches_the_two_ops(dtype, T, heads, d, rot, neox):
    for cache_dtype in (torch.float32, dtype):
        positions, q, k, v, caches, slots, cos_sin = _rope_case(T, *heads, d, rot, dtype, cache_dtype, seed=T + d)
        q2, k2 = q.clone(), k.clone()
        caches2 = [c.clone() for c in caches]
        OP.rotary_embedding_and_cache(positions, q, k, v, *caches, slots, d, cos_sin, neox)
        OP.rotary_embedding(positions, q2, k2, d, cos_sin, neox)
        OP.reshape_and_cache(*caches2, k2.view(T, -1, d), v.view(T, -1, d), slots)
        assert torch.equal(q, q2) and torch.equal(k, k2)
        for got, want in zip(caches, caches2):
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))  # unwritten rows stay NaN in both


def test_rope_and_cache_matches_reference():
    positions, q, k, v, caches, slots, cos_sin = _rope_case(9, 16, 4, 64, 64, torch.bfloat16, torch.float32, seed=3)
    qr, kr = q.clone(), k.clone()
    ref_caches = [c.clone() for c in caches]
    OP.rotary_embedding_and_cache(positions, q, k, v, *caches, slots, 64, cos_sin, True)
    fref.rotary_embedding_and_cache(positions, qr, kr, v, *ref_caches, slots, 64, cos_sin, True)
    assert_close(q, qr)
    assert_close(k, kr)
    for got, want in zip(caches, ref_caches):
        assert_close(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_rope_and_cache_errors():
    positions, q, k, v, caches, slots, cos_sin = _rope_case(5, 4, 2, 64, 64, torch.bfloat16, torch.float32)
    with pytest.raises(RuntimeError, match="key_cache"):  # an int8 cache takes the two quantized ops
        OP.rotary_embedding_and_cache(positions, q, k, v, caches[0].to(torch.int8), caches[1].to(torch.int8),
                                      slots, 64, cos_sin, True)
    with pytest.raises(RuntimeError, match="value shape"):
        OP.rotary_embedding_and_cache(positions, q, k, v[:, :64], *caches, slots, 64, cos_sin, True)
    with pytest.raises(RuntimeError, match="key must have shape"):
        OP.rotary_embedding_and_cache(positions, q, k, v, *caches, slots[:4], 64, cos_sin, True)
    with pytest.raises(RuntimeError, match="head_size"):
        OP.rotary_embedding_and_cache(positions, q, k, v, *caches, slots, 48, cos_sin[:, :32], True)


# ------------------------------------------------------------------------------------- norm / activation + GEMV
# K: 64 (fewer vectors than threads), 2048 (one vector per thread), 4104 (513 vectors: the norm's 512-thread block),
# 8200 (bf16: 1025 vectors, 512; fp32: 2050, 1024 threads), 1001 (no 16-byte vectors: the fallback),
# 24576 (bf16 48 KiB: too long for shared memory, the fallback)
NORM_K = [64, 2048, 4104, 8200, 1001, 24576]


def _norm_case(M, K, N, dtype, add, seed=0):
    x = _rand(M, K, dtype=dtype, seed=seed)
    residual = _rand(M, K, dtype=dtype, seed=seed + 1, scale=2.0) if add else None
    norm_w = _rand(K, dtype=dtype, seed=seed + 2, scale=0.5) + 1.0
    w = _rand(N, K, dtype=dtype, seed=seed + 3, scale=K ** -0.5)
    b = _rand(N, dtype=dtype, seed=seed + 4) if N % 2 else None
    return x, residual, norm_w, w, b


def _two_ops_norm(x, residual, norm_w, eps, w, b, kernel, pdl):
    h = x.clone()
    r = None if residual is None else residual.clone()
    if r is None:
        OP.rms_norm(h, x, norm_w, eps)
    else:
        OP.fused_add_rms_norm(h, r, norm_w, eps)
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device="cuda")
    OP.linear_gemv(out, h, w, b, kernel, pdl)
    return out, r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", NORM_K)
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("M,N,kernel,pdl", [(1, 17, 4, True), (1, 1537, 2, False), (3, 300, 3, True), (2, 9, 4, False)])
def test_rms_norm_linear_matches_the_two_ops(dtype, K, add, M, N, kernel, pdl):
    if K == 24576 and dtype is torch.float32:
        pytest.skip("the fp32 fallback is covered at K = 8200 (over 40 KiB already)")
    x, residual, norm_w, w, b = _norm_case(M, K, N, dtype, add, seed=K + M)
    x0, r0 = x.clone(), None if residual is None else residual.clone()
    out = poison(torch.empty(M, N, dtype=dtype, device="cuda"))
    residual_out = poison(torch.empty_like(x)) if add else None
    OP.rms_norm_linear(out, residual_out, x, residual, norm_w, 1e-5, w, b, kernel, pdl)
    want, want_res = _two_ops_norm(x, residual, norm_w, 1e-5, w, b, kernel, False)
    assert torch.equal(out, want)
    if add:
        assert torch.equal(residual_out, want_res)
        assert torch.equal(residual, r0)
    assert torch.equal(x, x0)  # inputs untouched
    expected = torch.empty_like(out)
    expected_res = torch.empty_like(x) if add else None
    fref.rms_norm_linear(expected, expected_res, x, residual, norm_w, 1e-5, w, b)
    assert_close(out, expected, scale=max(4.0, (K / 64) ** 0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [64, 2048, 8200, 1001, 24576])
@pytest.mark.parametrize("M,N,kernel,pdl", [(1, 17, 4, True), (1, 2048, 2, False), (3, 300, 3, True)])
def test_silu_and_mul_linear_matches_the_two_ops(dtype, K, M, N, kernel, pdl):
    if K == 24576 and dtype is torch.float32:
        pytest.skip("the fp32 fallback is covered at K = 8200")
    gate_up = _rand(M, 2 * K + 8, dtype=dtype, seed=K)[:, : 2 * K]  # a strided row, as a merged projection leaves it
    w = _rand(N, K, dtype=dtype, seed=K + 1, scale=K ** -0.5)
    b = _rand(N, dtype=dtype, seed=K + 2) if N % 2 else None
    out = poison(torch.empty(M, N, dtype=dtype, device="cuda"))
    OP.silu_and_mul_linear(out, gate_up, w, b, kernel, pdl)
    h = torch.empty(M, K, dtype=dtype, device="cuda")
    OP.silu_and_mul(h, gate_up)
    want = torch.empty_like(out)
    OP.linear_gemv(want, h, w, b, kernel, False)
    assert torch.equal(out, want)
    expected = torch.empty_like(out)
    fref.silu_and_mul_linear(expected, gate_up, w, b)
    assert_close(out, expected, scale=max(4.0, (K / 64) ** 0.5))


def _fused_layer(x, residual, bufs, wts, pdl):
    """A decoder layer's linears at M = 1 with the norms and the activation folded: every kernel reads what the one
    before it wrote (PDL: each GEMV fetches weights before the previous kernel ends)."""
    qkv, res1, h, gate_up, res2, down = bufs
    norm1, w_qkv, w_o, norm2, w_gu, w_down = wts
    OP.rms_norm_linear(qkv, res1, x, residual, norm1, 1e-5, w_qkv, None, 4, pdl)
    OP.linear_gemv(h, qkv[:, : h.shape[1]], w_o, None, 4, pdl)  # stands in for attention + o_proj
    OP.rms_norm_linear(gate_up, res2, h, res1, norm2, 1e-5, w_gu, None, 4, pdl)
    OP.silu_and_mul_linear(down, gate_up, w_down, None, 4, pdl)


def test_fused_pdl_chain_in_cuda_graph():
    hdim, inter, dt = 2048, 5632, torch.bfloat16
    wts = (_rand(hdim, dtype=dt, seed=1) + 1, _rand(3072, hdim, dtype=dt, seed=2) / 45, _rand(hdim, hdim, dtype=dt,
           seed=3) / 45, _rand(hdim, dtype=dt, seed=4) + 1, _rand(2 * inter, hdim, dtype=dt, seed=5) / 45,
           _rand(hdim, inter, dtype=dt, seed=6) / 75)
    x, residual = torch.empty(1, hdim, dtype=dt, device="cuda"), torch.empty(1, hdim, dtype=dt, device="cuda")

    def buffers():
        return [torch.empty(1, n, dtype=dt, device="cuda") for n in (3072, hdim, hdim, 2 * inter, hdim, hdim)]

    graph_bufs = buffers()
    _fused_layer(x, residual, graph_bufs, wts, True)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _fused_layer(x, residual, graph_bufs, wts, True)
    eager_bufs = buffers()
    for seed in range(10, 20):
        x.copy_(_rand(1, hdim, dtype=dt, seed=seed))
        residual.copy_(_rand(1, hdim, dtype=dt, seed=seed + 100))
        for b in graph_bufs:
            b.fill_(float("nan"))
        graph.replay()
        _fused_layer(x, residual, eager_bufs, wts, False)
        torch.cuda.synchronize()
        for got, want in zip(graph_bufs, eager_bufs):
            assert torch.equal(got, want), seed


def test_norm_and_act_linear_errors():
    x, residual, norm_w, w, b = _norm_case(1, 256, 8, torch.bfloat16, True)
    out, res_out = torch.empty(1, 8, dtype=torch.bfloat16, device="cuda"), torch.empty_like(x)
    with pytest.raises(RuntimeError, match="kernel must be 2, 3 or 4"):
        OP.rms_norm_linear(out, res_out, x, residual, norm_w, 1e-5, w, b, 1, False)
    with pytest.raises(RuntimeError, match="given together"):
        OP.rms_norm_linear(out, None, x, residual, norm_w, 1e-5, w, b, 4, False)
    with pytest.raises(RuntimeError, match="must not overlap"):
        OP.rms_norm_linear(out, x, x, residual, norm_w, 1e-5, w, b, 4, False)
    with pytest.raises(RuntimeError, match="norm_weight must have shape"):
        OP.rms_norm_linear(out, res_out, x, residual, norm_w[:100], 1e-5, w, b, 4, False)
    with pytest.raises(RuntimeError, match="residual must have x's shape"):
        OP.rms_norm_linear(out, res_out, x, residual[:, :128], norm_w, 1e-5, w, b, 4, False)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        OP.silu_and_mul_linear(out, x, w, b, 4, False)  # x [1, 256] is gate | up of K = 128
    with pytest.raises(RuntimeError, match=r"gate \| up"):
        OP.silu_and_mul_linear(out, x[:, :255], w, b, 4, False)
    torch.library.opcheck(OP.rms_norm_linear.default, (out, res_out, x, residual, norm_w, 1e-5, w, b, 4, True))
    torch.library.opcheck(OP.silu_and_mul_linear.default, (out, x, w[:, :128].contiguous(), b, 4, True))
