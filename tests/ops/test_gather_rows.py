"""gather_rows (the CPU embedding lookup and logits-row gather) against index_select: every dtype, int32 /
int64 indices, repeats, strided sources and outputs, a gather large enough to split over threads; bad indices
raise before any row is written; the embedding / row helpers of pagellm.ops.row_dispatch match torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm import ops
from pagellm.ops import row_dispatch
from ops.op_helpers import requires_ops

pytestmark = requires_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rows,d,n", [(1, 1, 1), (37, 577, 65), (5, 3, 0), (2000, 1031, 700)])
def test_matches_index_select(dtype, index_dtype, rows, d, n):
    g = torch.Generator().manual_seed(rows + d + n)
    src = (torch.randn(rows, d, generator=g) * 50).to(dtype)
    index = torch.randint(0, rows, (n,), generator=g, dtype=torch.int64).to(index_dtype)
    out = torch.full((n, d), 7).to(dtype)
    ops.gather_rows(out, src, index)
    assert torch.equal(out, src.index_select(0, index.to(torch.int64)))


def test_strided_source_and_output():
    g = torch.Generator().manual_seed(5)
    big = torch.randn(40, 300, generator=g).to(torch.bfloat16)
    src = big[3:30, 17:250]  # row stride 300
    index = torch.tensor([26, 0, 5, 5, 13])
    out_big = torch.zeros(5, 400, dtype=torch.bfloat16)
    out = out_big[:, 100:333]  # row stride 400
    ops.gather_rows(out, src, index)
    assert torch.equal(out, src[index])
    assert not out_big[:, :100].any() and not out_big[:, 333:].any()  # nothing outside out's columns
    col = torch.randn(50, 9, generator=g).t()  # column stride 50: read through a contiguous copy
    o = torch.empty(3, 50)
    ops.gather_rows(o, col, torch.tensor([8, 0, 4]))
    assert torch.equal(o, col[[8, 0, 4]])


def test_bad_indices_write_nothing():
    src = torch.randn(6, 8)
    out = torch.full((3, 8), 3.0)
    for bad in ([0, 6, 1], [-1, 0, 0]):
        with pytest.raises(ValueError, match="index values"):
            ops.gather_rows(out, src, torch.tensor(bad))
        with pytest.raises(RuntimeError, match="out of range"):
            torch.ops.pagellm.gather_rows(out, src, torch.tensor(bad))
    assert torch.equal(out, torch.full((3, 8), 3.0))
    with pytest.raises(TypeError):
        ops.gather_rows(out, src, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(TypeError):
        ops.gather_rows(out.to(torch.bfloat16), src, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError):
        ops.gather_rows(torch.empty(2, 8), src, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError):
        ops.gather_rows(out, src, torch.tensor([[0, 1, 2]]))
    with pytest.raises(RuntimeError, match="out must have shape"):
        torch.ops.pagellm.gather_rows(torch.empty(3, 7), src, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="dtype int64 or int32"):
        torch.ops.pagellm.gather_rows(out, src, torch.tensor([0, 1, 2], dtype=torch.int16))


def test_row_dispatch_helpers_match_torch():
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(101, 33, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 101, (4, 7), generator=g)
    assert torch.equal(row_dispatch.embedding(ids, weight), F.embedding(ids, weight))
    assert torch.equal(row_dispatch.embedding(ids[0], weight), F.embedding(ids[0], weight))
    assert torch.equal(row_dispatch.gather_rows(weight, ids[1]), weight[ids[1]])
    w = weight.float().requires_grad_()
    e = row_dispatch.embedding(ids, w)  # autograd: torch's embedding, so the gradient flows
    e.sum().backward()
    assert torch.equal(w.grad.sum(dim=1), torch.bincount(ids.flatten(), minlength=101).float() * 33)
