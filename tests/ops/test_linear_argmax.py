"""linear_argmax (the greedy LM head with its argmax fused in) against the two ops it replaces: exactly
argmax_rows(linear_small_m(x, w, bias)) on random inputs of odd sizes in every float dtype (the logits rounded to
the dtype, the first maximum, a NaN counting as the maximum), ties across the pool's chunks resolved to the lowest
index, and close to the pure-torch reference; bad arguments raise before anything is written."""

from __future__ import annotations

import pytest
import torch

from pagellm import ops
from pagellm.ops import reference as ref
from ops.op_helpers import requires_ops

pytestmark = requires_ops
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _fused(x, w, bias=None) -> torch.Tensor:
    out = torch.full((x.shape[0],), -7, dtype=torch.int64)
    ops.linear_argmax(out, x, w, bias)
    return out


def _two_ops(x, w, bias=None) -> torch.Tensor:
    logits = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
    ops.linear_small_m(logits, x, w, bias)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    ops.argmax_rows(out, logits)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 7, 33), (1, 37, 577), (1, 4099, 64), (1, 12291, 96),
                                   (2, 1001, 31), (3, 61, 200), (5, 4099, 65), (17, 333, 96), (70, 129, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_argmax_of_linear_small_m(dtype, m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 100_003 + n * 31 + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    got = _fused(x, w, bias)
    assert torch.equal(got, _two_ops(x, w, bias))
    # the reference's logits (fp32 products, one rounding) may differ by a rounding step from the kernel's sum order:
    # the chosen token's reference logit is the row's maximum within that
    want = torch.empty(m, dtype=torch.int64)
    ref.linear_argmax(want, x, w, bias)
    logits = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    picked, best = logits.gather(1, got[:, None])[:, 0], logits.max(dim=1).values
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert torch.all(best - picked <= tol * (1 + best.abs())), (got, want)


# verify steps' rows (2-16: the fused multi-row path; 17: the logits path next door) at odd K / N: one 240-row block
# with a short tail (N 241), several blocks and pool chunks (N 5003, K 577: ~5.8 MB in bf16), a partial 32-element
# K chunk (K 31), K 1536 (3-4 packed quads leave L1: the side-by-side tiles), N below one 4-row tile (N 3)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(241, 31), (5003, 577), (3, 200), (731, 1536)])
def test_multi_row_fused_path_every_m(dtype, n, k):
    g = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(17, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    for m in range(1, 18):
        for b in (None, bias):
            got = _fused(x[:m], w, b)
            assert torch.equal(got, _two_ops(x[:m], w, b)), (m, b is None)
            if m > 1:  # each row's token is the row's alone (batch invariance of the fused rows)
                assert got[m - 1].item() == _fused(x[m - 1 : m], w, b).item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_row_edge_values(dtype):
    """2-16 rows: every logit -inf (the first index), a NaN in a chunk's first vector or in a short last block (the
    first NaN), +inf beside NaNs; each as argmax_rows of the stored logits and torch.argmax rule."""
    g = torch.Generator().manual_seed(3)
    n, k = 5003, 40
    x = torch.rand(16, k, generator=g).to(dtype) + 0.5
    w = (torch.randn(n, k, generator=g) / 8).to(dtype)
    minus_inf = torch.full((n,), float("-inf")).to(dtype)
    first_nan, late_nan = w.clone(), w.clone()
    first_nan[0, 1] = float("nan")
    first_nan[4000, 0] = float("nan")
    late_nan[n - 2, 5] = float("nan")  # in the last, partial block of logits
    late_nan[n - 300, :] = float("inf")
    for weight, bias, expect in ((w, minus_inf, 0), (first_nan, None, 0), (late_nan, None, n - 2)):
        for m in (2, 5, 9, 16):
            got = _fused(x[:m], weight, bias)
            assert torch.equal(got, _two_ops(x[:m], weight, bias))
            assert got.tolist() == [expect] * m


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_and_nans_follow_torch_argmax(dtype):
    """Duplicated maximal weight rows far apart (different chunks of the pool): the lowest index; a NaN logit beats
    every number, the first NaN winning; +inf beats finite values."""
    g = torch.Generator().manual_seed(5)
    n, k = 20_011, 48  # ~ 2 MB of bf16 weight: several chunks per thread
    x = torch.rand(4, k, generator=g).to(dtype) + 0.5  # positive, so the scaled row below is the maximum
    w = (torch.randn(n, k, generator=g) / 8).to(dtype)
    top = torch.rand(k, generator=g).to(dtype) + 1.0
    for r in (19_990, 7_003, 15_000):  # the same maximal logit in three chunks: 7003 must win
        w[r] = top
    nan_w = w.clone()
    nan_w[12_345, 3] = float("nan")
    nan_w[16_000, 0] = float("nan")  # the first NaN (12345) wins, wherever the chunks fall
    inf_w = w.clone()
    inf_w[18_000, :] = float("inf")  # x > 0: +inf logits beat the finite maximum
    for weight, expect in ((w, 7_003), (nan_w, 12_345), (inf_w, 18_000)):
        got = _fused(x, weight)
        assert torch.equal(got, _two_ops(x, weight))
        assert got.tolist() == [expect] * 4
    # with a single row (the fused path that never stores the logits), the same answers
    for weight, expect in ((w, 7_003), (nan_w, 12_345), (inf_w, 18_000)):
        assert _fused(x[:1], weight).item() == expect


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_and_row_independence(dtype):
    """x rows a view of a wider hidden state (the runner's last-position slice); a row's token is the same
    alone or beside other rows (batch invariance)."""
    g = torch.Generator().manual_seed(11)
    base = torch.randn(6, 300, generator=g).to(dtype)
    x = base[:, 7:263]  # 256 columns, rows 300 apart
    w = torch.randn(3001, 256, generator=g).to(dtype)
    got = _fused(x, w)
    assert torch.equal(got, _two_ops(x.contiguous(), w))
    for r in range(x.shape[0]):
        assert _fused(x[r : r + 1], w).item() == got[r].item()


def test_empty_rows_and_zero_k():
    w = torch.randn(9, 0)
    assert _fused(torch.empty(0, 0), w).shape == (0,)
    bias = torch.tensor([0.0, 3.0, -1.0, 3.0, 0, 0, 0, 0, 0])
    assert _fused(torch.empty(2, 0), w, bias).tolist() == [1, 1]  # logits = bias: the first 3.0


def test_bad_arguments_raise_before_writing():
    x, w = torch.randn(2, 16), torch.randn(5, 16)
    out = torch.full((2,), -7, dtype=torch.int64)
    cases = [
        (TypeError, (out.to(torch.int32), x, w)),  # out dtype
        (ValueError, (out[:1], x, w)),  # out rows
        (ValueError, (out, x, torch.randn(5, 15))),  # K
        (TypeError, (out, x, w.to(torch.bfloat16))),  # mixed dtypes
        (ValueError, (out, x, torch.randn(0, 16))),  # no vocabulary
        (ValueError, (out, x[0], w)),  # x not 2-D
        (ValueError, (out, x, w, torch.randn(4))),  # bias length
        (TypeError, (out, x.to(torch.int32), w)),  # x not float
    ]
    for exc, args in cases:
        with pytest.raises(exc):
            ops.linear_argmax(*args)
        assert out.tolist() == [-7, -7]
    for args in ((out, x, torch.randn(5, 15)), (out.to(torch.int32), x, w), (out, x, torch.randn(0, 16))):
        with pytest.raises(RuntimeError):
            torch.ops.pagellm.linear_argmax(*args, None)  # the C++ checks, without the Python wrapper
        assert out.tolist() == [-7, -7]
