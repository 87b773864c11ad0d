"""lora_apply (batched multi-adapter LoRA, shrink then expand by adapter slot) against its pure-torch reference
and a plain per-token computation: odd sizes, slots mixed with -1, ranks below r_max, dtypes, strided rows,
opcheck, bad input."""

from __future__ import annotations

import pytest
import torch

from ops.op_helpers import assert_close, requires_ops
from pagellm import ops
from pagellm.ops import reference

pytestmark = requires_ops
OP = torch.ops.pagellm


def _inputs(T, K, N, S, R, dtype, device, seed=0, ranks=None, none_every=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    y = torch.randn(T, N, generator=g).to(dtype)
    a = torch.randn(S, R, K, generator=g) / K**0.5
    b = torch.randn(S, N, R, generator=g)
    for s, r in enumerate(ranks or []):  # adapters of rank r < R: zero-padded rows of A / columns of B
        a[s, r:] = 0
        b[s, :, r:] = 0
    slots = torch.randint(0, S, (T,), generator=g, dtype=torch.int32)
    slots[::none_every] = -1
    scales = torch.rand(S, generator=g) * 2
    return [t.to(device) for t in (y, x, a.to(dtype), b.to(dtype), scales, slots)]


def _per_token(y, x, a, b, scales, slots):
    out = y.float().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] += scales[s] * (b[s].float() @ (a[s].float() @ x[t].float()))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,K,N,S,R", [(1, 64, 96, 1, 8), (37, 50, 70, 3, 8), (130, 33, 200, 4, 16), (5, 17, 9, 2, 1)])
def test_lora_apply_matches_reference(device, dtype, T, K, N, S, R):
    y, x, a, b, scales, slots = _inputs(T, K, N, S, R, dtype, device, ranks=[max(1, R // 2)] + [R] * (S - 1))
    expected = y.clone()
    reference.lora_apply(expected, x, a, b, scales, slots)
    assert_close(expected, _per_token(y, x, a, b, scales, slots), dtype, scale=4)
    actual = y.clone()
    ops.lora_apply(actual, x, a, b, scales, slots)
    assert_close(actual, expected, dtype, scale=4)
    untouched = slots == -1
    assert torch.equal(actual[untouched], y[untouched])


def test_lora_apply_strided_rows_and_no_adapter(device):
    y, x, a, b, scales, slots = _inputs(20, 40, 30, 2, 4, torch.float32, device)
    wide_x = torch.randn(20, 64, device=device)
    wide_x[:, 8:48] = x
    wide_y = torch.randn(20, 50, device=device)
    wide_y[:, 5:35] = y
    expected = y.clone()
    reference.lora_apply(expected, x, a, b, scales, slots)
    before = wide_y.clone()
    ops.lora_apply(wide_y[:, 5:35], wide_x[:, 8:48], a, b, scales, slots)
    assert_close(wide_y[:, 5:35], expected)
    assert torch.equal(wide_y[:, :5], before[:, :5]) and torch.equal(wide_y[:, 35:], before[:, 35:])
    none = torch.full_like(slots, -1)
    y2 = y.clone()
    ops.lora_apply(y2, x, a, b, scales, none)
    assert torch.equal(y2, y)


def test_lora_apply_opcheck(device):
    args = _inputs(9, 24, 20, 3, 4, torch.float32, device)
    torch.library.opcheck(OP.lora_apply.default, tuple(args))


def test_lora_apply_bad_input():
    y, x, a, b, scales, slots = _inputs(6, 16, 12, 2, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="token_slots must be in"):
        ops.lora_apply(y, x, a, b, scales, torch.full_like(slots, 2))
    with pytest.raises(TypeError, match="token_slots"):
        ops.lora_apply(y, x, a, b, scales, slots.long())
    with pytest.raises(TypeError, match="lora_a"):
        ops.lora_apply(y, x, a.double(), b, scales, slots)
    with pytest.raises(ValueError, match="lora_b"):
        ops.lora_apply(y, x, a, b[:, :, :3], scales, slots)
    with pytest.raises(TypeError, match="scales"):
        ops.lora_apply(y, x, a, b, scales.double(), slots)
    cases = [
        ("token_slots", lambda: OP.lora_apply(y, x, a, b, scales, torch.full_like(slots, -2))),
        ("lora_b", lambda: OP.lora_apply(y, x, a, b.transpose(1, 2).contiguous(), scales, slots)),
        ("scales", lambda: OP.lora_apply(y, x, a, b, scales[:1], slots)),
        ("y", lambda: OP.lora_apply(y[:5], x, a, b, scales, slots)),
        ("x", lambda: OP.lora_apply(y, x.t().contiguous().t(), a, b, scales, slots)),
    ]
    for name, fn in cases:
        with pytest.raises(RuntimeError, match=name):
            fn()
            pytest.fail(f"no error for a bad {name}")
    y_before = y.clone()
    with pytest.raises(RuntimeError):
        OP.lora_apply(y, x, a, b, scales, torch.tensor([0, 1, 5, 0, 0, 0], dtype=torch.int32))
    assert torch.equal(y, y_before)  # slots are checked before anything is written
