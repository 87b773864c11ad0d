"""linear_gemv on CUDA (kernels 1-4 of docs/cuda.md, PDL) against the reference: odd sizes that reach every K-slice
count, K tails and the scalar fallback, strided x, bias; a row's bits independent of M and of PDL; PDL launches
inside a CUDA graph after the norm / activation kernels that release them; the dispatch's environment switches."""

from __future__ import annotations

import pytest
import torch

from pagellm import ops
from pagellm.ops import linear_dispatch
from pagellm.ops import reference as ref
from ops.op_helpers import assert_close, poison, requires_ops

pytestmark = requires_ops
OP = torch.ops.pagellm
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rand(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).cuda()


@requires_cuda
@pytest.mark.parametrize("kernel", [2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 9, 17])  # MR = 1, 2, 4 (3 rows), 8, then several row blocks
# 64: lanes with no vector; 1001: no 16-byte vectors (kernel 1's scalar path); 2048 x 1537: 2-4 K slices and a
# column tail; 8200 x 9: 8 uneven slices; 4104 x 2500: several chunks per lane
@pytest.mark.parametrize("K,N", [(64, 1), (576, 17), (1001, 37), (2048, 1537), (8200, 9), (4104, 2500)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_gemv_cuda(kernel, M, K, N, dtype):
    x = _rand(M, K + 24, dtype=dtype)[:, 8 : 8 + K] if M % 2 else _rand(M, K, dtype=dtype)
    w = _rand(N, K, dtype=dtype, seed=1)
    b = _rand(N, dtype=dtype, seed=2) if (M + N) % 2 else None
    out = poison(torch.empty(M, N, dtype=dtype, device="cuda"))
    expected = torch.empty(M, N, dtype=dtype, device="cuda")
    OP.linear_gemv(out, x, w, b, kernel, False)
    ref.linear_gemv(expected, x, w, b)
    assert_close(out, expected, scale=max(1.0, (K / 64) ** 0.5))


@requires_cuda
@pytest.mark.parametrize("kernel", [1, 2, 3, 4])
@pytest.mark.parametrize("K,N", [(2048, 1537), (8200, 9), (4104, 2500)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_gemv_rows_independent_of_m_and_pdl(kernel, K, N, dtype):
    """out[m] has the same bits whether computed alone, in a batch of 2, 4, 8 or 17 rows, with or without PDL;
    kernel 4 (kernel 2's K slices, fewer vectors in flight) gives kernel 2's bits."""
    x, w, b = _rand(17, K, dtype=dtype), _rand(N, K, dtype=dtype, seed=1), _rand(N, dtype=dtype, seed=2)
    alone = torch.empty(17, N, dtype=dtype, device="cuda")
    for m in range(17):
        OP.linear_gemv(alone[m : m + 1], x[m : m + 1], w, b, kernel, False)
    for rows in (2, 4, 8, 17):
        for pdl in (False, True):
            out = poison(torch.empty(rows, N, dtype=dtype, device="cuda"))
            OP.linear_gemv(out, x[:rows], w, b, kernel, pdl)
            assert torch.equal(out, alone[:rows]), (rows, pdl)
    if kernel == 4:
        k2 = torch.empty_like(alone)
        OP.linear_gemv(k2, x, w, b, 2, False)
        assert torch.equal(k2, alone)


def _decode_mlp(x0, norm_w, w_gate_up, w_down, w_next, bufs, kernel, pdl):
    """norm -> GEMV -> silu_and_mul -> GEMV -> GEMV: each GEMV reads what the kernel before it wrote."""
    xn, gate_up, act, down, nxt = bufs
    ops.rms_norm(xn, x0, norm_w, 1e-5)
    OP.linear_gemv(gate_up, xn, w_gate_up, None, kernel, pdl)
    ops.silu_and_mul(act, gate_up)
    OP.linear_gemv(down, act, w_down, None, kernel, pdl)
    OP.linear_gemv(nxt, down, w_next, None, kernel, pdl)


@requires_cuda
@pytest.mark.parametrize("kernel", [2, 3, 4])
def test_pdl_chain_in_cuda_graph(kernel):
    """PDL-launched GEMVs (weights fetched before the wait) replayed in a CUDA graph give the eager, non-PDL bits
    for every new input: no GEMV reads its x before the kernel that writes it has finished."""
    h, inter, dt = 2048, 5632, torch.bfloat16
    norm_w = _rand(h, dtype=dt, seed=3)
    w_gate_up, w_down = _rand(2 * inter, h, dtype=dt, seed=4) / 8, _rand(h, inter, dtype=dt, seed=5) / 16
    w_next = _rand(3000, h, dtype=dt, seed=6) / 8
    x0 = torch.empty(1, h, dtype=dt, device="cuda")

    def buffers():
        return [torch.empty(1, n, dtype=dt, device="cuda") for n in (h, 2 * inter, inter, h, 3000)]

    graph_bufs = buffers()
    x0.copy_(_rand(1, h, dtype=dt, seed=0))
    _decode_mlp(x0, norm_w, w_gate_up, w_down, w_next, graph_bufs, kernel, True)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _decode_mlp(x0, norm_w, w_gate_up, w_down, w_next, graph_bufs, kernel, True)
    eager_bufs = buffers()
    for seed in range(10, 30):
        x0.copy_(_rand(1, h, dtype=dt, seed=seed))
        graph_bufs[-1].fill_(float("nan"))
        graph.replay()
        _decode_mlp(x0, norm_w, w_gate_up, w_down, w_next, eager_bufs, kernel, False)
        torch.cuda.synchronize()
        for got, want in zip(graph_bufs, eager_bufs):
            assert torch.equal(got, want), seed
    expected = torch.empty_like(eager_bufs[-1])
    ref.linear_gemv(expected, eager_bufs[-2], w_next, None)
    assert_close(eager_bufs[-1], expected, scale=(h / 64) ** 0.5)


@requires_cuda
def test_linear_gemv_errors_and_dispatch(monkeypatch):
    x, w = _rand(3, 128, dtype=torch.bfloat16), _rand(20, 128, dtype=torch.bfloat16, seed=1)
    out = torch.empty(3, 20, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="kernel must be 1, 2, 3 or 4"):
        OP.linear_gemv(out, x, w, None, 5, False)
    with pytest.raises(RuntimeError, match="weight must be a CUDA tensor"):
        OP.linear_gemv(out, x, w.cpu(), None, 2, False)
    with pytest.raises(RuntimeError, match="out must have shape"):
        OP.linear_gemv(out[:, :19], x, w, None, 2, False)
    torch.library.opcheck(OP.linear_gemv.default, (out, x, w, None, 2, True))
    monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_MAX_M", 4)
    for kernel, pdl in ((2, False), (3, True), (4, True)):
        monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_KERNEL", kernel)
        monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_PDL", pdl)
        OP.linear_gemv(out, x, w, None, kernel, pdl)
        assert torch.equal(linear_dispatch.linear(x, w), out)


def test_env_choice_names_the_allowed_values(monkeypatch):
    """PAGELLM_CUDA_GEMV_KERNEL / PAGELLM_CUDA_PDL are read through _env_choice: a bad value is a ValueError."""
    monkeypatch.setenv("PAGELLM_CUDA_GEMV_KERNEL", "5")
    with pytest.raises(ValueError, match="PAGELLM_CUDA_GEMV_KERNEL must be one of 1, 2, 3, 4, got '5'"):
        linear_dispatch._env_choice("PAGELLM_CUDA_GEMV_KERNEL", "1", ("1", "2", "3", "4"))
    monkeypatch.setenv("PAGELLM_CUDA_GEMV_KERNEL", "3")
    assert linear_dispatch._env_choice("PAGELLM_CUDA_GEMV_KERNEL", "1", ("1", "2", "3", "4")) == "3"
    monkeypatch.delenv("PAGELLM_CUDA_PDL", raising=False)
    assert linear_dispatch._env_choice("PAGELLM_CUDA_PDL", "0", ("0", "1")) == "0"
