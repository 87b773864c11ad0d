"""argmax_rows (the greedy sampler's row argmax on the CPU) against torch.argmax: exact indices with the
first-maximum tie rule and NaN counted as the maximum, in every float dtype, odd widths, strided rows;
a row's answer does not depend on the rows beside it; bad arguments raise before anything is written."""

from __future__ import annotations

import pytest
import torch

from pagellm import ops
from ops.op_helpers import requires_ops

pytestmark = requires_ops
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _argmax(x: torch.Tensor) -> torch.Tensor:
    out = torch.full((x.shape[0],), -7, dtype=torch.int64)
    ops.argmax_rows(out, x)
    return out


def _hard_rows(v: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(12, v, generator=g).to(dtype)
    x[1] = torch.randint(0, 3, (v,), generator=g).to(dtype)  # many ties: the first index wins
    x[2, -1] = 50.0  # the maximum in the tail past the last full vector step
    x[3, 0] = 50.0
    x[4, v // 2] = float("nan")
    x[5] = float("-inf")  # all equal: index 0
    x[6, v // 3] = float("inf")
    x[7, v - 1] = 60.0
    x[7, v // 5] = 60.0  # a tie between two lanes / steps: the lower index
    x[8, v // 2] = 70.0
    x[8, v - 1] = float("nan")  # a NaN after the maximum still wins
    x[9, v // 7] = float("nan")
    x[9, v // 3] = float("nan")  # the first of two NaNs
    x[10] = 0.0
    x[10, v - 1] = float("inf")
    x[10, v // 4] = float("-inf")
    x[11, (v * 5) // 6] = float("inf")
    x[11, v // 6] = float("inf")  # two +inf: the first
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [1, 5, 63, 64, 65, 127, 1000, 4099, 49153])
def test_matches_torch_argmax(dtype, v):
    g = torch.Generator().manual_seed(v)
    x = _hard_rows(v, dtype, g)
    assert torch.equal(_argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_column_slices(dtype):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(7, 333, generator=g).to(dtype)
    x = base[:, 5:300]  # rows 333 apart, 295 columns
    assert x.stride() == (333, 1)
    assert torch.equal(_argmax(x), x.argmax(dim=-1))
    t = torch.randn(301, 9, generator=g).to(dtype).t()  # column stride 9: copied contiguous
    assert torch.equal(_argmax(t), t.argmax(dim=-1))


def test_row_answer_is_batch_invariant():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(67, 2049, generator=g).to(torch.bfloat16)
    x[:, 100] = x[:, 1900] = 9.0  # a tie in every row
    full = _argmax(x)
    assert torch.equal(full, x.argmax(dim=-1))
    for i in (0, 1, 33, 66):
        assert torch.equal(_argmax(x[i : i + 1]), full[i : i + 1])
        assert torch.equal(_argmax(x[i:]), full[i:])


def test_empty_batch_writes_nothing():
    out = torch.empty(0, dtype=torch.int64)
    ops.argmax_rows(out, torch.empty(0, 17))
    assert out.shape == (0,)


def test_bad_arguments():
    x = torch.randn(3, 10)
    out = torch.full((3,), -1, dtype=torch.int64)
    with pytest.raises(TypeError):
        ops.argmax_rows(out, torch.zeros(3, 10, dtype=torch.int32))
    with pytest.raises(TypeError):
        ops.argmax_rows(out.to(torch.int32), x)
    with pytest.raises(ValueError):
        ops.argmax_rows(torch.empty(2, dtype=torch.int64), x)
    with pytest.raises(ValueError):
        ops.argmax_rows(out, x.view(3, 2, 5))
    with pytest.raises(ValueError):
        ops.argmax_rows(out, torch.empty(3, 0))
    with pytest.raises(RuntimeError, match="out must have shape"):
        torch.ops.pagellm.argmax_rows(torch.empty(4, dtype=torch.int64), x)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.pagellm.argmax_rows(torch.empty(3, dtype=torch.int32), x)
    with pytest.raises(RuntimeError, match="at least one column"):
        torch.ops.pagellm.argmax_rows(out, torch.empty(3, 0))
    assert torch.equal(out, torch.full((3,), -1, dtype=torch.int64))  # nothing written by a refused call
