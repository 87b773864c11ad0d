"""fused_moe: the routed experts of a mixture-of-experts MLP (gate_up = X_e W13_e^T, act(gate) * up, . W2_e^T,
weighted combine) against the pure-torch per-expert loop of `ops.moe_reference`, on odd sizes (H, I not multiples
of 16 / 32, E = 3..9, k = 1..3, distinct random ids, experts without tokens), every dtype, both activations,
both CPU paths (the weight-streaming tiles for experts with <= 32 pairs, the grouped GEMM for busier ones: odd
sizes, top-k 1 / 2 / 6, E = 3..64, empty experts), strided inputs, batch independence, opcheck and bad input.

Tolerances: both sides compute in fp32 from the same input values (intermediates stay fp32) and round once, so
they differ by summation order only: fp32 within 2e-5 (abs and rel), bf16 / fp16 within TOL[dtype] (2e-2 / 2e-3,
i.e. about one ulp of the output).
"""

from __future__ import annotations

import pytest
import torch

from pagellm import ops
from pagellm.ops import moe_reference
from ops.op_helpers import DEVICES, TOL, requires_ops

pytestmark = requires_ops
OP = torch.ops.pagellm
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
# (T, H, I, E, k): decode and small batches (tile path), then busy experts (> 32 pairs each: the GEMM path)
SHAPES = [(1, 45, 37, 8, 2), (3, 70, 23, 5, 3), (17, 33, 50, 9, 1), (64, 45, 37, 9, 3), (64, 40, 29, 3, 2),
          (200, 24, 19, 4, 2)]


def make_moe(T, H, I, E, k, dtype, device="cpu", seed=0, num_used_experts=None):
    """Random hidden [T, H], w13 [E, 2I, H], w2 [E, H, I] (scaled for unit-size outputs), weights [T, k] and
    distinct ids [T, k] drawn from the first `num_used_experts` experts (the rest get no tokens)."""
    g = torch.Generator().manual_seed(seed)
    used = E if num_used_experts is None else num_used_experts
    hidden = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    ids = torch.rand(T, used, generator=g).argsort(dim=1)[:, :k].to(torch.int32)
    weights = torch.rand(T, k, generator=g)
    return (hidden.to(dtype).to(device), w13.to(dtype).to(device), w2.to(dtype).to(device), weights.to(device),
            ids.to(device))


def check(out: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOL[out.dtype]
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-H{s[1]}-I{s[2]}-E{s[3]}-k{s[4]}" for s in SHAPES])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_matches_reference(device, dtype, shape, activation):
    args = make_moe(*shape, dtype, device)
    out = ops.fused_moe(*args, activation)
    check(out, moe_reference.fused_moe(*args, activation))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_unused_experts_and_duplicate_weights(device, dtype):
    """Experts 5..8 get no tokens; equal combine weights; the op reads only the chosen experts (NaN elsewhere)."""
    hidden, w13, w2, weights, ids = make_moe(19, 52, 41, 9, 2, dtype, device, seed=3, num_used_experts=5)
    weights[:4] = 0.5
    w13[5:], w2[5:] = float("nan"), float("nan")
    out = OP.fused_moe(hidden, w13, w2, weights, ids, "silu")
    assert not out.isnan().any()
    check(out, moe_reference.fused_moe(hidden, w13[:5], w2[:5], weights, ids, "silu"))


# The grouped GEMM (experts with > 32 pairs): odd H / I (K tails of both products, bf16 pairs with a lone last k),
# weight-row counts that are not multiples of the register tile or the 48-row chunk, several 32-pair blocks per
# expert with a partial last one, top-k 1 / 2 / 6, E = 3..64 with some experts below the threshold (tile path).
GEMM_SHAPES = [(150, 33, 50, 3, 2), (100, 45, 37, 3, 1), (90, 70, 23, 8, 6), (400, 31, 19, 64, 6),
               (70, 128, 96, 4, 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=[f"T{s[0]}-H{s[1]}-I{s[2]}-E{s[3]}-k{s[4]}" for s in GEMM_SHAPES])
def test_grouped_gemm_matches_reference(dtype, shape):
    args = make_moe(*shape, dtype, seed=shape[0])
    counts = torch.bincount(args[4].flatten().long(), minlength=shape[3])
    assert (counts > 32).any()  # the case reaches the grouped GEMM
    check(ops.fused_moe(*args, "silu"), moe_reference.fused_moe(*args, "silu"))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grouped_gemm_empty_experts_and_unread_weights(dtype):
    """Busy experts 0..4 (60 pairs each), experts 5..8 empty and NaN: the GEMM never reads past an expert's rows
    (odd H: the bf16 pair loads stop at the row's last value)."""
    hidden, w13, w2, weights, ids = make_moe(150, 53, 41, 9, 2, dtype, seed=11, num_used_experts=5)
    w13[5:], w2[5:] = float("nan"), float("nan")
    out = OP.fused_moe(hidden, w13, w2, weights, ids, "gelu_tanh")
    assert not out.isnan().any()
    check(out, moe_reference.fused_moe(hidden, w13[:5], w2[:5], weights, ids, "gelu_tanh"))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_grouped_gemm_token_result_does_not_depend_on_the_batch(dtype):
    """While every expert a token uses stays on the grouped GEMM (> 32 pairs), its output is bitwise the same
    in a batch of 96 tokens or of 130 (other pair blocks, other partial last blocks)."""
    hidden, w13, w2, weights, ids = make_moe(130, 40, 36, 3, 2, dtype, seed=13)
    full = OP.fused_moe(hidden, w13, w2, weights, ids, "silu")
    assert (torch.bincount(ids[:96].flatten().long(), minlength=3) > 32).all()
    part = OP.fused_moe(hidden[:96], w13, w2, weights[:96], ids[:96], "silu")
    assert torch.equal(part, full[:96])


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs(device):
    """hidden with a row stride > H, w2 and topk tensors as non-contiguous views."""
    hidden, w13, w2, weights, ids = make_moe(7, 36, 27, 6, 2, torch.bfloat16, device, seed=5)
    wide = torch.zeros(7, 50, dtype=hidden.dtype, device=device)
    wide[:, 3:39] = hidden
    w2_wide = torch.zeros(6, 36, 30, dtype=w2.dtype, device=device)
    w2_wide[:, :, :27] = w2
    ids_t, weights_t = ids.t().contiguous().t(), weights.t().contiguous().t()
    out = OP.fused_moe(wide[:, 3:39], w13, w2_wide[:, :, :27], weights_t, ids_t, "gelu_tanh")
    check(out, moe_reference.fused_moe(hidden, w13, w2, weights, ids, "gelu_tanh"))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_token_result_does_not_depend_on_the_batch(dtype):
    """With <= 32 pairs per expert (the tile path) a token's output is bitwise the same alone or in a batch."""
    hidden, w13, w2, weights, ids = make_moe(17, 75, 45, 6, 2, dtype, seed=7)
    batch = OP.fused_moe(hidden, w13, w2, weights, ids, "silu")
    for t in (0, 8, 16):
        alone = OP.fused_moe(hidden[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], "silu")
        assert torch.equal(alone[0], batch[t])


def test_empty_cases():
    hidden, w13, w2, weights, ids = make_moe(4, 16, 8, 3, 2, torch.float32)
    empty = OP.fused_moe(hidden[:0], w13, w2, weights[:0], ids[:0], "silu")
    assert empty.shape == (0, 16)
    no_experts = OP.fused_moe(hidden, w13, w2, weights[:, :0], ids[:, :0], "silu")
    assert torch.equal(no_experts, torch.zeros(4, 16))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(3, 40, 24, 4, 2), (40, 24, 20, 3, 3)], ids=["tile", "gemm"])
def test_opcheck(dtype, shape):
    torch.library.opcheck(OP.fused_moe.default, (*make_moe(*shape, dtype), "gelu_tanh"))


def _bad(**changes):
    args = dict(zip(("hidden", "w13", "w2", "topk_weights", "topk_ids"), make_moe(4, 16, 8, 3, 2, torch.float32)))
    args["activation"] = "silu"
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes,error,match",
    [
        ({"hidden": torch.zeros(4, 16, dtype=torch.int32)}, TypeError, "hidden must be float32"),
        ({"w13": torch.zeros(3, 16, 16, dtype=torch.bfloat16)}, TypeError, "w13 must have the dtype of hidden"),
        ({"topk_weights": torch.zeros(4, 2, dtype=torch.float64)}, TypeError, "topk_weights must have dtype"),
        ({"topk_ids": torch.zeros(4, 2, dtype=torch.int64)}, TypeError, "topk_ids must have dtype torch.int32"),
        ({"activation": "relu"}, ValueError, "activation must be one of silu, gelu_tanh"),
        ({"hidden": torch.zeros(4, 16, 1)}, ValueError, "hidden must have 2 dimensions"),
        ({"w13": torch.zeros(3, 15, 16)}, ValueError, r"w13 shape \(3, 15, 16\) must be \[E, 2 \* I, H = 16\]"),
        ({"w2": torch.zeros(3, 16, 7)}, ValueError, r"w2 shape \(3, 16, 7\) must be \[E, H, I\] = \(3, 16, 8\)"),
        ({"topk_ids": torch.zeros(5, 2, dtype=torch.int32)}, ValueError, "topk_ids shape"),
        ({"topk_weights": torch.zeros(4, 3)}, ValueError, "topk_weights shape"),
        ({"topk_ids": torch.full((4, 4), 0, dtype=torch.int32), "topk_weights": torch.zeros(4, 4)}, ValueError,
         "more than the E = 3 experts"),
        ({"topk_ids": torch.tensor([[0, 1], [2, 3], [0, 1], [1, 2]], dtype=torch.int32)}, ValueError,
         r"topk_ids must be in \[0, E = 3\), got 3"),
        ({"topk_ids": torch.tensor([[0, 1], [-1, 2], [0, 1], [1, 2]], dtype=torch.int32)}, ValueError, "got -1"),
    ],
)
def test_wrapper_errors(changes, error, match):
    with pytest.raises(error, match=match):
        ops.fused_moe(**_bad(**changes))


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"activation": "relu"}, 'activation must be "silu" or "gelu_tanh"'),
        ({"topk_ids": torch.tensor([[0, 1], [2, 0], [0, 7], [1, 2]], dtype=torch.int32)},
         r"topk_ids must be in \[0, E = 3\), got 7 at \[2, 1\]"),
        ({"topk_ids": torch.zeros(4, 2, dtype=torch.int64)}, "topk_ids must have dtype Int"),
        ({"w2": torch.zeros(3, 16, 9)}, "w2 must have shape"),
        ({"hidden": torch.zeros(4, 16, dtype=torch.float16)}, "w13 must have the same dtype as hidden"),
    ],
)
def test_op_errors(changes, match):
    """The op checks again (RuntimeError) when called without the wrapper."""
    args = _bad(**changes)
    with pytest.raises(RuntimeError, match=match):
        OP.fused_moe(*args.values())


def test_step_graph_replay():
    """A decode step that calls the op can be captured and replayed (a returned tensor, a str argument)."""
    from pagellm.step_graph import StepRecorder, build_step_graph

    hidden, w13, w2, weights, ids = make_moe(2, 40, 24, 5, 2, torch.bfloat16, seed=11)
    fn = lambda ins: OP.fused_moe(ins[0], w13, w2, ins[1], ins[2], "gelu_tanh") * 2  # noqa: E731
    recorder = StepRecorder([hidden, weights, ids], lambda t: t is w13 or t is w2)
    with recorder:
        out = fn([hidden, weights, ids])
    graph = build_step_graph(recorder.recording, [recorder.slot(out)])
    new = make_moe(2, 40, 24, 5, 2, torch.bfloat16, seed=12)
    new_inputs = [new[0], new[3], new[4]]
    assert torch.equal(graph.run(new_inputs)[0], fn(new_inputs))
