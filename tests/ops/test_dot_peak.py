"""bf16_dot_peak (the benchmarks' bf16 ceiling: a register-only vdpbf16ps loop) against its reference: every
iteration of every chain ran (the sum is exact), in the loaded kernel library; bad arguments are refused."""

from __future__ import annotations

import pytest
import torch

from pagellm import ops
from pagellm.ops import reference as ref
from ops.op_helpers import poison, requires_ops

pytestmark = requires_ops
OP = torch.ops.pagellm


@pytest.mark.parametrize("num_iters", [0, 1, 7, 1000, 1 << 20])
def test_bf16_dot_peak_matches_reference(num_iters):
    out, expected = poison(torch.empty(16)), torch.empty(16)
    ops.bf16_dot_peak(out, num_iters)
    ref.bf16_dot_peak(expected, num_iters)
    assert torch.equal(out, expected)
    assert float(out[0]) == 12 * num_iters / 64


def test_bf16_dot_peak_errors():
    with pytest.raises(TypeError, match="out"):
        ops.bf16_dot_peak(torch.empty(16, dtype=torch.bfloat16), 1)
    with pytest.raises(ValueError, match="out shape"):
        ops.bf16_dot_peak(torch.empty(15), 1)
    with pytest.raises(ValueError, match="num_iters"):
        ops.bf16_dot_peak(torch.empty(16), (1 << 20) + 1)
    with pytest.raises(ValueError, match="num_iters"):
        ops.bf16_dot_peak(torch.empty(16), -1)
    # C++ checks (RuntimeError naming the argument)
    with pytest.raises(RuntimeError, match="num_iters"):
        OP.bf16_dot_peak(torch.empty(16), -1)
    with pytest.raises(RuntimeError, match="out must be a contiguous float32"):
        OP.bf16_dot_peak(torch.empty(32)[::2], 1)
