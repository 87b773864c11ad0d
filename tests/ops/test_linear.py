"""linear_small_m (out = x @ weight^T + bias, weight-streaming kernel for small M) and linear_amx (bf16 on AMX
tiles) against the reference, plus opcheck and bad-argument errors; and the layer routing (bf16 by row count ->
small-M kernel / AMX kernel / F.linear, fp32 -> the small-M kernel at every M, autograd -> exactly F.linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm import ops
from pagellm.ops import reference as ref
from ops.op_helpers import assert_close, poison, requires_ops

pytestmark = requires_ops
OP = torch.ops.pagellm


def _rand(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


requires_amx = pytest.mark.skipif(not ops.amx_available(), reason="needs a CPU with AMX-BF16 (and a build that has it)")


def _check(M, K, N, dtype, with_bias, x_strided=False, op="linear_small_m"):
    if x_strided:  # rows with a stride > K
        x = _rand(M, K + 24, dtype=dtype)[:, 8 : 8 + K]
    else:
        x = _rand(M, K, dtype=dtype)
    w = _rand(N, K, dtype=dtype, seed=1)
    b = _rand(N, dtype=dtype, seed=2) if with_bias else None
    out = poison(torch.empty(M, N, dtype=dtype))
    expected = torch.empty(M, N, dtype=dtype)
    getattr(ops, op)(out, x, w, b)
    getattr(ref, op)(expected, x, w, b)
    # sums of K products: scale the tolerance with sqrt(K) (bf16 rounding of the fp32 sum, reduction order)
    assert_close(out, expected, scale=max(1.0, (K / 64) ** 0.5))


@pytest.mark.parametrize("M", [1, 2, 3, 7, 16, 33])
@pytest.mark.parametrize("K", [64, 576, 896, 1000])
@pytest.mark.parametrize("N", [1, 17, 1536])
def test_linear_small_m_bf16(M, K, N):
    _check(M, K, N, torch.bfloat16, with_bias=(M + N) % 2 == 0)


@pytest.mark.parametrize("M", [8, 13, 64, 67, 131])  # the GEMM schedule (>= 8 bf16 rows): tiles, edges, blocks
@pytest.mark.parametrize("K,N", [(576, 33), (1000, 1537), (31, 70)])
def test_linear_small_m_bf16_many_rows(M, K, N):
    _check(M, K, N, torch.bfloat16, with_bias=(M + N) % 2 == 1, x_strided=M % 2 == 1)


@pytest.mark.parametrize("M", [2, 3, 4, 5, 6, 9, 11, 14, 16, 17])  # verify rows: 1-4 quads, padded, then the GEMM
@pytest.mark.parametrize("K,N", [(33, 7), (200, 49), (1536, 70)])
def test_linear_small_m_bf16_few_rows(M, K, N):
    _check(M, K, N, torch.bfloat16, with_bias=(M + N) % 2 == 1, x_strided=M % 2 == 0)


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 13, 64, 67, 131, 300])  # decode rows, 4-row tiles, 64-row blocks
@pytest.mark.parametrize("K,N", [(576, 33), (1000, 1537), (31, 70), (1536, 5)])
def test_linear_small_m_fp32_every_m(M, K, N):
    """fp32 linears of every M run this kernel (linear_dispatch): odd sizes, K tails, strided x, bias."""
    _check(M, K, N, torch.float32, with_bias=(M + N) % 2 == 0, x_strided=M % 2 == 1)


@pytest.mark.parametrize("M,K,N", [(1, 576, 4099), (5, 1000, 4099), (2, 31, 9), (1, 7, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_linear_small_m_dtypes_bias(M, K, N, with_bias, dtype):
    _check(M, K, N, dtype, with_bias, x_strided=True)


def test_linear_small_m_strided_out_and_empty():
    x, w = _rand(3, 96, dtype=torch.bfloat16), _rand(40, 96, dtype=torch.bfloat16, seed=1)
    buf = poison(torch.empty(3, 64, dtype=torch.bfloat16))
    out = buf[:, 8:48]
    ops.linear_small_m(out, x, w)
    expected = torch.empty(3, 40, dtype=torch.bfloat16)
    ref.linear_small_m(expected, x, w)
    assert_close(out, expected, scale=2.0)
    assert buf[:, :8].isnan().all() and buf[:, 48:].isnan().all()  # nothing written outside the view
    ops.linear_small_m(torch.empty(0, 40, dtype=torch.bfloat16), x[:0], w)  # M = 0 is a no-op


def test_linear_small_m_opcheck():
    x, w, b = _rand(3, 100, dtype=torch.bfloat16), _rand(20, 100, dtype=torch.bfloat16, seed=1), _rand(20, dtype=torch.bfloat16)
    torch.library.opcheck(OP.linear_small_m.default, (torch.empty(3, 20, dtype=torch.bfloat16), x, w, b))
    torch.library.opcheck(OP.linear_small_m.default, (torch.empty(3, 20, dtype=torch.bfloat16), x, w, None))


def test_linear_small_m_errors():
    x, w = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    out = torch.empty(2, 8, dtype=torch.bfloat16)
    # Python wrapper
    with pytest.raises(TypeError, match="weight"):
        ops.linear_small_m(out, x, w.float())
    with pytest.raises(TypeError, match="x"):
        ops.linear_small_m(out, x.long(), w)
    with pytest.raises(ValueError, match="weight shape"):
        ops.linear_small_m(out, x, torch.randn(8, 63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out shape"):
        ops.linear_small_m(torch.empty(2, 9, dtype=torch.bfloat16), x, w)
    # C++ checks (RuntimeError naming the argument)
    with pytest.raises(RuntimeError, match="weight must have the same dtype as x"):
        OP.linear_small_m(out, x, w.float(), None)
    with pytest.raises(RuntimeError, match="out must have the same dtype as x"):
        OP.linear_small_m(out.float(), x, w, None)
    with pytest.raises(RuntimeError, match="x must be float32"):
        OP.linear_small_m(out, x.int(), w.int(), None)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        OP.linear_small_m(out, x, torch.randn(8, 32, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="out must have shape"):
        OP.linear_small_m(torch.empty(3, 8, dtype=torch.bfloat16), x, w, None)
    with pytest.raises(RuntimeError, match="bias must have shape"):
        OP.linear_small_m(out, x, w, torch.randn(9, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x must have 2 dimensions"):
        OP.linear_small_m(out, x[None], w, None)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@requires_cuda
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 9, 17])  # MR = 1, 2, 4 (3 rows), 8, then several row blocks
@pytest.mark.parametrize("K,N", [(64, 1), (576, 17), (1001, 37), (2048, 1537), (8200, 9)])  # 1001: scalar path
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_small_m_cuda(M, K, N, dtype):
    """The CUDA GEMV (gemv_cuda.cuh) against the reference on the GPU: odd sizes, K tails past the unrolled
    vectors (8200), a K with no 16-byte vectors, strided x rows, bias, every output written."""
    x = _rand(M, K + 24, dtype=dtype)[:, 8 : 8 + K].cuda() if M % 2 else _rand(M, K, dtype=dtype).cuda()
    w = _rand(N, K, dtype=dtype, seed=1).cuda()
    b = _rand(N, dtype=dtype, seed=2).cuda() if (M + N) % 2 else None
    out = poison(torch.empty(M, N, dtype=dtype, device="cuda"))
    expected = torch.empty(M, N, dtype=dtype, device="cuda")
    OP.linear_small_m(out, x, w, b)
    ref.linear_small_m(expected, x, w, b)
    assert_close(out, expected, scale=max(1.0, (K / 64) ** 0.5))


@requires_cuda
def test_linear_small_m_cuda_opcheck_and_dispatch(monkeypatch):
    """opcheck on CUDA; linear_dispatch sends CUDA bf16 rows up to CUDA_GEMV_MAX_M (1 by default: set to 4 here) to
    the GEMV (kernel 1, linear_small_m's, set here: same bits as the op), more rows and autograd to F.linear."""
    from pagellm.ops import linear_dispatch

    monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_MAX_M", 4)
    monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_KERNEL", 1)
    monkeypatch.setattr(linear_dispatch, "CUDA_GEMV_PDL", False)

    x, w = _rand(3, 128, dtype=torch.bfloat16).cuda(), _rand(20, 128, dtype=torch.bfloat16, seed=1).cuda()
    b = _rand(20, dtype=torch.bfloat16, seed=2).cuda()
    out = torch.empty(3, 20, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(OP.linear_small_m.default, (out, x, w, b))
    OP.linear_small_m(out, x, w, b)
    assert torch.equal(linear_dispatch.linear(x, w, b), out)
    many = _rand(linear_dispatch.CUDA_GEMV_MAX_M + 1, 128, dtype=torch.bfloat16).cuda()
    assert torch.equal(linear_dispatch.linear(many, w, b), F.linear(many, w, b))
    with pytest.raises(RuntimeError, match="weight must be a CUDA tensor"):
        OP.linear_small_m(out, x, w.cpu(), None)


@requires_amx
@pytest.mark.parametrize("M", [1, 3, 5, 16, 17, 33, 64, 100, 300])
@pytest.mark.parametrize("K,N", [(31, 17), (64, 1), (200, 33), (896, 1152), (1000, 100), (4864, 40)])
def test_linear_amx(M, K, N):
    # odd M (partial 16-row panels), K not a multiple of the 32-wide tile, N not a multiple of the 32-row block
    _check(M, K, N, torch.bfloat16, with_bias=(M + K) % 2 == 1, x_strided=M % 2 == 1, op="linear_amx")


@requires_amx
def test_linear_amx_strided_out_and_rows_independent():
    x, w = _rand(70, 96, dtype=torch.bfloat16), _rand(40, 96, dtype=torch.bfloat16, seed=1)
    b = _rand(40, dtype=torch.bfloat16, seed=2)
    buf = poison(torch.empty(70, 64, dtype=torch.bfloat16))
    out = buf[:, 8:48]
    ops.linear_amx(out, x, w, b)
    expected = torch.empty(70, 40, dtype=torch.bfloat16)
    ref.linear_amx(expected, x, w, b)
    assert_close(out, expected, scale=2.0)
    assert buf[:, :8].isnan().all() and buf[:, 48:].isnan().all()  # nothing written outside the view
    # every row sums k in the same order whatever the other rows are: bitwise batch invariance
    for rows in (slice(0, 3), slice(17, 18), slice(30, 63)):
        part = torch.empty(x[rows].shape[0], 40, dtype=torch.bfloat16)
        ops.linear_amx(part, x[rows], w, b)
        assert torch.equal(part, out[rows])
    ops.linear_amx(torch.empty(0, 40, dtype=torch.bfloat16), x[:0], w)  # M = 0 is a no-op
    empty_k = torch.empty(4, 40, dtype=torch.bfloat16)
    ops.linear_amx(empty_k, x[:4, :0], w[:, :0], b)  # K = 0: the bias
    assert torch.equal(empty_k, b.expand(4, 40))


def test_linear_amx_errors():
    x, w = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    out = torch.empty(8, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="x must have dtype torch.bfloat16"):
        ops.linear_amx(out.float(), x.float(), w.float())
    with pytest.raises(ValueError, match="weight shape"):
        ops.linear_amx(out, x, torch.randn(8, 63, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        OP.linear_amx(out.float(), x.float(), w.float(), None)
    if ops.amx_available():
        with pytest.raises(RuntimeError, match="bias must have shape"):
            OP.linear_amx(out, x, w, torch.randn(9, dtype=torch.bfloat16))
    else:
        with pytest.raises(RuntimeError, match="does not provide AMX-BF16"):
            OP.linear_amx(out, x, w, None)


def test_layer_routing():
    from pagellm.layers.embedding import LMHead
    from pagellm.layers.linear import AMX_MAX_M, SMALL_M_MAX, Linear

    lin = Linear(96, 40, bias=True, dtype=torch.float32)
    with torch.no_grad():
        lin.weight.copy_(_rand(40, 96, dtype=torch.float32))
        lin.bias.copy_(_rand(40, dtype=torch.float32, seed=3))
    for shape in ((1, 1, 96), (3, 5, 96), (131, 96)):  # fp32: linear_small_m at every M, close to F.linear
        x = _rand(*shape, dtype=torch.float32)
        y = lin(x)
        own = torch.empty(x.numel() // 96, 40)
        OP.linear_small_m(own, x.reshape(-1, 96), lin.weight, lin.bias)
        assert y.shape == shape[:-1] + (40,) and torch.equal(y.reshape(-1, 40), own)
        assert_close(y, F.linear(x, lin.weight, lin.bias), scale=2.0)
    xg = _rand(4, 96, dtype=torch.float32).requires_grad_()
    assert torch.equal(lin(xg), F.linear(xg, lin.weight, lin.bias))  # autograd: exactly F.linear
    lin = lin.to(torch.bfloat16)
    edges = (1, SMALL_M_MAX, SMALL_M_MAX + 1, SMALL_M_MAX + 3, AMX_MAX_M, AMX_MAX_M + 1)
    for m in (m for m in edges if 0 < m <= 4096):  # without AMX, SMALL_M_MAX is 'every M'
        xb = _rand(m, 96, dtype=torch.bfloat16)
        y = lin(xb)
        assert y.shape == (m, 40) and y.dtype == torch.bfloat16
        assert_close(y, F.linear(xb.float(), lin.weight.float(), lin.bias.float()), dtype=torch.bfloat16, scale=2.0)
    head = LMHead(50, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(_rand(50, 96, dtype=torch.bfloat16))
    h = _rand(2, 96, dtype=torch.bfloat16)
    logits = head(h)
    assert logits.dtype == torch.bfloat16 and logits.shape == (2, 50)  # the model dtype, as HF's lm_head
    assert_close(logits, F.linear(h.float(), head.weight.float()), dtype=torch.bfloat16, scale=2.0)
