"""int8_linear (LLM.int8()) against its pure-torch reference and against the fp32 product of the unquantized weight.

Tolerances:
  - vs the reference: the int8 x int8 -> int32 sums are exact on both sides and the activation quantization
    is the same IEEE arithmetic, so without outlier columns and without bias the result is bit-identical.
    With outliers or bias only the fp32 sums of the outlier term and the order of the final additions
    differ: rtol 1e-5 (fp32 output) or one bf16 / fp16 ulp (rtol 2^-7 / 2^-10) after the one rounding.
  - vs F.linear(x, w) in fp32 with the unquantized w: the worst-case quantization error, per element,
    |x| . |w - w_dq| + |x - x_dq| . |w_dq| <= (w_scale / 2) sum|x| + (s_m / 2) sum|w_dq| over the int8
    columns (outlier columns carry only the weight term), plus fp32 slack and the output rounding.
  - every ISA path (AVX-512 VNNI, AVX2, plain C++) gives bit-identical output (same integers, same epilogue).
Every test of the arithmetic runs for both activation schemes: absmax int8 rows and zero_point uint8 rows
(s_m = (max - min) / 255 over the row's range widened to hold 0, so the per-element error bound has s_m / 2 too).
Per-token groups (group_size 64 / 128: one absmax scale per group of K) sum each group's int32 products times
its scale in fp32, in another order than the reference: rtol 1e-5 (fp32) / one output ulp against it; the
ISA paths agree bit for bit (same lane order, int8_group_tiles.h).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ops.op_helpers import poison, requires_ops
from pagellm import ops
from pagellm.ops import reference
from pagellm.quantization.int8 import dequantize_weight_rows, quantize_weight_rows

pytestmark = requires_ops
OUT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}
OUTLIER_COLS = (3, 40, 41)  # planted columns (K >= 42)
THRESHOLD = 6.0


def make_inputs(M, K, N, dtype, *, outliers: bool, bias: bool, device="cpu", seed=0):
    """x [M, K] in dtype (|x| < 4 except planted outlier columns of magnitude 8-40 in a few rows), the float
    weight [N, K] and its int8 quantization, bias [N] or None."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 1.2).clamp(-4, 4)
    if outliers:
        for c in OUTLIER_COLS:
            rows = torch.randint(0, M, (max(1, M // 4),), generator=g)
            x[rows, c] = (torch.rand(len(rows), generator=g) * 32 + 8) * torch.sign(torch.randn(len(rows), generator=g))
    w = torch.randn(N, K, generator=g) * 0.05
    q, scale = quantize_weight_rows(w)
    b = (torch.randn(N, generator=g) * 0.1).to(dtype).to(device) if bias else None
    return x.to(dtype).to(device), w.to(device), q.to(device), scale.to(device), b


def run_op(x, q, scale, b, threshold=THRESHOLD, zero_point=False, group_size=0):
    out = poison(torch.empty(x.shape[0], q.shape[0], dtype=x.dtype, device=x.device))
    ops.int8_linear(out, x, q, scale, b, threshold, zero_point, group_size)
    return out


def run_reference(x, q, scale, b, threshold=THRESHOLD, zero_point=False, group_size=0):
    out = torch.empty(x.shape[0], q.shape[0], dtype=x.dtype, device=x.device)
    reference.int8_linear(out, x, q, scale, b, threshold, zero_point, group_size)
    return out


ZP_IDS = ["absmax", "zeropoint"]


def error_bound(x, q, scale, threshold, zero_point=False, group_size=0):
    """Worst-case |int8 result - x @ w^T| per element (see the module docstring), for the unquantized w."""
    xf = x.float().cpu()
    q, scale = q.cpu(), scale.cpu()
    outlier = xf.abs().amax(0) > threshold if threshold > 0 else torch.zeros(xf.shape[1], dtype=torch.bool)
    x_in = torch.where(outlier, 0.0, xf)
    if zero_point:  # per-row activation scale
        s = (x_in.amax(1).clamp(min=0) - x_in.amin(1).clamp(max=0)) / 255.0
    else:
        s = x_in.abs().amax(1) / 127.0
    w_dq = dequantize_weight_rows(q, scale).abs()
    weight_term = (scale[None, :] / 2) * xf.abs().sum(1, keepdim=True)
    if group_size:  # the scale of each element's group: sum_k s_m,g(k) / 2 |w_dq[n, k]| over the int8 columns
        s_k = torch.cat([x_in[:, k0:k0 + group_size].abs().amax(1, keepdim=True).expand(-1, min(group_size,
                         xf.shape[1] - k0)) for k0 in range(0, xf.shape[1], group_size)], dim=1) / 127.0
        return weight_term + (s_k * (~outlier).float()) @ w_dq.T / 2
    return weight_term + (s[:, None] / 2) * (w_dq @ (~outlier).float())[None, :]


# ---------------------------------------------------------------- against the reference
@pytest.mark.parametrize("zero_point", [False, True], ids=ZP_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("outliers", [False, True], ids=["plain", "outliers"])
@pytest.mark.parametrize("M", [1, 3, 17, 64])
def test_matches_reference(M, outliers, bias, dtype, zero_point, device):
    K, N = 131, 45  # neither a multiple of 64 (the VNNI block) nor of 4 (the register tile)
    x, _, q, scale, b = make_inputs(M, K, N, dtype, outliers=outliers, bias=bias, device=device, seed=M)
    if zero_point:  # skewed rows: the zero point is far from the middle of the code range
        x = (x.float() + 0.5 * (torch.arange(M, device=device)[:, None] % 3)).to(dtype)
    if outliers:  # the planted columns are the outlier set
        assert ((x.float().abs().amax(0) > THRESHOLD).nonzero().flatten().tolist()) == list(OUTLIER_COLS)
    out, ref = run_op(x, q, scale, b, zero_point=zero_point), run_reference(x, q, scale, b, zero_point=zero_point)
    if not outliers and not bias:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=OUT_RTOL[dtype], atol=1e-6)


@pytest.mark.parametrize("zero_point", [False, True], ids=ZP_IDS)
@pytest.mark.parametrize("K,N", [(1, 1), (63, 7), (64, 5), (65, 9), (389, 67), (1000, 3)])
def test_odd_shapes_match_reference(K, N, zero_point, device):
    x, _, q, scale, b = make_inputs(5, K, N, torch.float32, outliers=K > 41, bias=True, device=device, seed=K)
    zp = dict(zero_point=zero_point)
    torch.testing.assert_close(run_op(x, q, scale, b, **zp), run_reference(x, q, scale, b, **zp), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(run_op(x, q, scale, None, 0.0, **zp), run_reference(x, q, scale, None, 0.0, **zp),
                               rtol=0, atol=0)


@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("outliers", [False, True], ids=["plain", "outliers"])
@pytest.mark.parametrize("M", [1, 3, 17, 64])
def test_groups_match_reference(M, outliers, bias, dtype, group_size, device):
    K, N = 331, 45  # a short last group; N not a multiple of the register tile
    x, _, q, scale, b = make_inputs(M, K, N, dtype, outliers=outliers, bias=bias, device=device, seed=M)
    x = (x.float() * (1 + 4 * (torch.arange(K, device=device) // 64 % 2))).clamp(-5.9, 5.9).to(dtype)
    if outliers:
        x[:, list(OUTLIER_COLS)] = x[:, list(OUTLIER_COLS)] * 0 + 9.0
    gs = dict(group_size=group_size)
    out, ref = run_op(x, q, scale, b, **gs), run_reference(x, q, scale, b, **gs)
    torch.testing.assert_close(out.float(), ref.float(), rtol=OUT_RTOL[dtype], atol=1e-5)


@pytest.mark.parametrize("K,N", [(1, 1), (63, 7), (64, 5), (65, 9), (389, 67), (1000, 3)])
def test_groups_odd_shapes_match_reference(K, N, device):
    x, _, q, scale, b = make_inputs(5, K, N, torch.float32, outliers=K > 41, bias=True, device=device, seed=K)
    for threshold, bias in ((THRESHOLD, b), (0.0, None)):
        torch.testing.assert_close(run_op(x, q, scale, bias, threshold, group_size=64),
                                   run_reference(x, q, scale, bias, threshold, group_size=64), rtol=1e-5, atol=1e-5)


def test_groups_beat_one_scale_per_row(device):
    """A row whose magnitude differs between parts of K (as a hidden state's channels do): one scale per group
    of 64 keeps the small part's precision, one scale per row does not; both stay within their bounds."""
    x, w, q, scale, _ = make_inputs(16, 256, 64, torch.float32, outliers=False, bias=False, device=device)
    x[:, :64] *= 25.0  # one loud group (no outlier columns: threshold 0)
    exact = F.linear(x, w)
    err = {gs: (run_op(x, q, scale, None, 0.0, group_size=gs) - exact).norm() / exact.norm() for gs in (0, 64)}
    assert err[64] < 0.7 * err[0], err
    for gs in (0, 64):
        excess = (run_op(x, q, scale, None, 0.0, group_size=gs) - exact).abs() - error_bound(
            x, q, scale, 0.0, group_size=gs).to(x.device) * (1 + 1e-4) - 1e-5
        assert excess.max() <= 0, (gs, excess.max())


def test_float16_and_strided_input(device):
    x, _, q, scale, b = make_inputs(9, 150, 33, torch.float16, outliers=True, bias=True, device=device)
    wide = torch.zeros(9, 170, dtype=x.dtype, device=device)
    wide[:, 10:160] = x
    xs = wide[:, 10:160]  # row stride 170
    out = torch.zeros(9, 40, dtype=x.dtype, device=device)[:, 2:35]  # row stride 40
    ops.int8_linear(out, xs, q, scale, b, THRESHOLD)
    expected = run_reference(x, q, scale, b)
    torch.testing.assert_close(out.float(), expected.float(), rtol=OUT_RTOL[torch.float16], atol=1e-6)


@pytest.mark.parametrize("scheme", ["absmax", "zeropoint", "group64", "group128"])
def test_cpu_rows_are_batch_invariant_without_outlier_columns(scheme):
    """With no activation over the threshold every row is quantized and multiplied on its own, so a row gives the
    same bits in any batch (as linear_small_m's rows do): alone, in a slice, or among 100 rows (whose activation
    pass is split across threads)."""
    x, _, q, scale, b = make_inputs(100, 389, 67, torch.bfloat16, outliers=False, bias=True, seed=3)
    kw = dict(zero_point=scheme == "zeropoint", group_size=int(scheme[5:]) if scheme.startswith("group") else 0)
    full = run_op(x, q, scale, b, THRESHOLD, **kw)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(99, 100), slice(1, 66)):
        assert torch.equal(run_op(x[rows], q, scale, b, THRESHOLD, **kw), full[rows]), rows


# ---------------------------------------------------------------- the threshold
def test_threshold_zero_means_no_outlier_columns(device):
    """threshold 0 quantizes every column, outliers included; a threshold above every |x| is the same op."""
    x, _, q, scale, b = make_inputs(17, 131, 45, torch.float32, outliers=True, bias=True, device=device)
    no_outliers = run_op(x, q, scale, b, 0.0)
    assert torch.equal(no_outliers, run_op(x, q, scale, b, float(x.abs().max()) + 1.0))
    assert torch.equal(no_outliers, run_op(x, q, scale, b, float("inf")))
    torch.testing.assert_close(no_outliers, run_reference(x, q, scale, b, 0.0), rtol=1e-5, atol=1e-6)
    # the same x run with outlier columns differs (they are large: decomposing them changes the int8 rows)
    assert not torch.allclose(no_outliers, run_op(x, q, scale, b, THRESHOLD), rtol=1e-3, atol=1e-3)


def test_outlier_decomposition_beats_plain_int8(device):
    """The point of LLM.int8(): with a few large activation columns, keeping them in fp32 is far more accurate
    than quantizing them with the rest of the row."""
    x, w, q, scale, _ = make_inputs(64, 256, 96, torch.float32, outliers=True, bias=False, device=device)
    exact = F.linear(x.float(), w.float())
    err_mixed = (run_op(x, q, scale, None, THRESHOLD) - exact).norm() / exact.norm()
    err_plain = (run_op(x, q, scale, None, 0.0) - exact).norm() / exact.norm()
    assert err_mixed < err_plain / 3, (err_mixed, err_plain)
    assert err_mixed < 0.01  # stated: < 1 % relative (Frobenius) error on these inputs


# ---------------------------------------------------------------- against the unquantized fp32 product
@pytest.mark.parametrize("zero_point", [False, True, "group"], ids=ZP_IDS + ["group64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threshold", [0.0, THRESHOLD])
@pytest.mark.parametrize("M", [1, 3, 17, 64])
def test_within_quantization_error_of_fp32_matmul(M, threshold, dtype, zero_point, device):
    x, w, q, scale, b = make_inputs(M, 131, 45, dtype, outliers=True, bias=True, device=device, seed=M + 7)
    exact = F.linear(x.float(), w.float(), b.float()).cpu()
    group_size = 64 if zero_point == "group" else 0
    zero_point = zero_point is True
    out = run_op(x, q, scale, b, threshold, zero_point, group_size).float().cpu()
    bound = error_bound(x, q, scale, threshold, zero_point, group_size) * (1 + 1e-4) + 1e-5 + exact.abs() * OUT_RTOL[dtype]
    excess = (out - exact).abs() - bound
    assert excess.max() <= 0, f"error exceeds the quantization bound by {excess.max():.3g}"


def test_zero_point_halves_the_error_on_one_sided_rows(device):
    """Non-negative rows (e.g. after a ReLU) use only half of absmax's int8 codes; the zero point uses all 256,
    so its rounding error is about half, and the result stays within its (smaller) bound."""
    x, w, q, scale, _ = make_inputs(64, 256, 96, torch.float32, outliers=False, bias=False, device=device)
    x = x.abs()
    exact = F.linear(x, w.float())
    err = {zp: (run_op(x, q, scale, None, 0.0, zp) - exact).norm() / exact.norm() for zp in (False, True)}
    err_x = {zp: (reference_dequantized_rows(x, zp) - x).norm() for zp in (False, True)}
    assert err_x[True] < 0.6 * err_x[False], err_x
    assert err[True] < err[False], err


def reference_dequantized_rows(x, zero_point):
    """x's rows quantized and dequantized by the op's rule (threshold 0), read back through an identity weight."""
    eye_q, eye_scale = quantize_weight_rows(torch.eye(x.shape[1], device=x.device))
    return run_reference(x, eye_q, eye_scale, None, 0.0, zero_point)


def test_zero_point_keeps_zeroed_outlier_columns_exact(device):
    """The range always holds 0 and z is an integer, so zeroed outlier columns contribute exactly nothing: rows
    that are 0 apart from their outlier columns give exactly the fp32 outlier term, as absmax rows do (no NaN
    from the empty range), and an all-zero row gives 0."""
    x, w, q, scale, _ = make_inputs(8, 100, 12, torch.float32, outliers=True, bias=False, device=device)
    only_outliers = torch.zeros_like(x)
    only_outliers[:, list(OUTLIER_COLS)] = x[:, list(OUTLIER_COLS)].abs() + 10.0  # every row above the threshold
    zp = run_op(only_outliers, q, scale, None, THRESHOLD, True)
    assert torch.equal(zp, run_op(only_outliers, q, scale, None, THRESHOLD, False)) and zp.abs().min() > 0
    torch.testing.assert_close(zp, F.linear(only_outliers, dequantize_weight_rows(q, scale)), rtol=1e-5, atol=1e-6)
    assert torch.equal(run_op(torch.zeros_like(x), q, scale, None, THRESHOLD, True), torch.zeros_like(zp))


# ---------------------------------------------------------------- every ISA path
def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_ISA_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from ops.test_int8_linear import make_inputs, run_op
outs = []
for M, K, N, outliers, bias, dtype in [(1, 131, 45, False, False, torch.float32),
                                       (17, 389, 67, True, True, torch.bfloat16),
                                       (64, 64, 9, True, False, torch.float32),
                                       (3, 200, 5, False, False, torch.float32),
                                       (5, 1000, 3, False, True, torch.float32)]:
    x, _, q, scale, b = make_inputs(M, K, N, dtype, outliers=outliers, bias=bias, seed=K)
    for zero_point in (False, True):
        outs.append(run_op(x + 0.3 * zero_point, q, scale, b, zero_point=zero_point))
    for group_size in (64, 128):
        outs.append(run_op(x * (1 + (torch.arange(K) % 128 < 64)), q, scale, b, group_size=group_size))
torch.save(outs, sys.argv[1])
"""


def _run_with_isa(isa: str, path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PAGELLM_INT8_KERNEL=isa)
    script = _ISA_SCRIPT.format(tests=str(Path(__file__).resolve().parents[1]))
    return subprocess.run([sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True,
                          timeout=300)


def test_every_isa_path_is_bit_identical(tmp_path):
    flags = _cpu_flags()
    isas = ["scalar"] + (["avx2"] if "avx2" in flags else []) + (
        ["avx512_vnni"] if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags else [])
    if len(isas) < 2:
        pytest.skip(f"this CPU runs only the {isas} path (no AVX2): nothing to compare")
    results = {}
    for isa in isas:
        proc = _run_with_isa(isa, tmp_path / f"{isa}.pt")
        assert proc.returncode == 0, proc.stderr[-2000:]
        results[isa] = torch.load(tmp_path / f"{isa}.pt")
    for isa in isas[1:]:
        for a, b in zip(results["scalar"], results[isa]):
            assert torch.equal(a, b), isa


def test_forcing_an_unknown_isa_is_an_error(tmp_path):
    proc = _run_with_isa("avx9000", tmp_path / "x.pt")
    assert proc.returncode != 0 and "PAGELLM_INT8_KERNEL must be auto, avx512_vnni, avx2 or scalar" in proc.stderr


# ---------------------------------------------------------------- edges and bad input
def test_empty_shapes(device):
    q, scale = torch.zeros(4, 8, dtype=torch.int8, device=device), torch.ones(4, device=device)
    ops.int8_linear(torch.empty(0, 4, device=device), torch.empty(0, 8, device=device), q, scale, None, 6.0)
    out = poison(torch.empty(3, 4, device=device))
    bias = torch.arange(4.0, device=device)
    ops.int8_linear(out, torch.empty(3, 0, device=device), q[:, :0], scale, bias, 6.0)  # K = 0: bias only
    assert torch.equal(out, bias.expand(3, 4))
    zero_rows = torch.zeros(2, 8, device=device)  # absmax 0: scale 0, no NaN
    out = poison(torch.empty(2, 4, device=device))
    ops.int8_linear(out, zero_rows, q, scale, None, 6.0)
    assert torch.equal(out, torch.zeros(2, 4, device=device))


def test_wrapper_errors():
    x, q, scale = torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)
    out = torch.empty(2, 4)
    cases = [
        (TypeError, "weight", lambda: ops.int8_linear(out, x, q.float(), scale)),
        (TypeError, "weight_scale", lambda: ops.int8_linear(out, x, q, scale.bfloat16())),
        (TypeError, "x", lambda: ops.int8_linear(out, x.long(), q, scale)),
        (TypeError, "out", lambda: ops.int8_linear(out.bfloat16(), x, q, scale)),
        (TypeError, "bias", lambda: ops.int8_linear(out, x, q, scale, torch.zeros(4, dtype=torch.bfloat16))),
        (ValueError, "threshold", lambda: ops.int8_linear(out, x, q, scale, None, -1.0)),
        (ValueError, "threshold", lambda: ops.int8_linear(out, x, q, scale, None, float("nan"))),
        (TypeError, "zero_point must be a bool", lambda: ops.int8_linear(out, x, q, scale, None, 6.0, 1)),
        (ValueError, "zero_point int8_linear needs K < 65536",
         lambda: ops.int8_linear(torch.empty(1, 1), torch.zeros(1, 1 << 16), torch.zeros(1, 1 << 16, dtype=torch.int8),
                                 torch.ones(1), None, 6.0, True)),
        (ValueError, "group_size must be 0", lambda: ops.int8_linear(out, x, q, scale, None, 6.0, False, 32)),
        (ValueError, "group_size must be 0", lambda: ops.int8_linear(out, x, q, scale, None, 6.0, False, -64)),
        (TypeError, "group_size must be an int", lambda: ops.int8_linear(out, x, q, scale, None, 6.0, False, 64.0)),
        (ValueError, "zero_point must be False", lambda: ops.int8_linear(out, x, q, scale, None, 6.0, True, 64)),
        (ValueError, "weight shape", lambda: ops.int8_linear(out, x, q[:, :7], scale)),
        (ValueError, "weight_scale shape", lambda: ops.int8_linear(out, x, q, scale[:3])),
        (ValueError, "bias shape", lambda: ops.int8_linear(out, x, q, scale, torch.zeros(5))),
        (ValueError, "out shape", lambda: ops.int8_linear(torch.empty(2, 5), x, q, scale)),
        (ValueError, "x must have 2 dimensions", lambda: ops.int8_linear(out, x[None], q, scale)),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()


def test_cpp_errors_name_the_argument():
    x, q, scale = torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)
    op = torch.ops.pagellm.int8_linear
    cases = [
        ("weight must have dtype", lambda: op(torch.empty(2, 4), x, q.float(), scale, None, 6.0)),
        ("weight_scale must have shape", lambda: op(torch.empty(2, 4), x, q, scale[:2], None, 6.0)),
        ("bias must have shape", lambda: op(torch.empty(2, 4), x, q, scale, torch.zeros(3), 6.0)),
        ("out must have shape", lambda: op(torch.empty(3, 4), x, q, scale, None, 6.0)),
        ("threshold must be >= 0", lambda: op(torch.empty(2, 4), x, q, scale, None, -0.5)),
        ("group_size must be 0", lambda: op(torch.empty(2, 4), x, q, scale, None, 6.0, False, 96)),
        ("zero_point must be false", lambda: op(torch.empty(2, 4), x, q, scale, None, 6.0, True, 64)),
        ("too large for int32", lambda: op(torch.empty(1, 1), torch.zeros(1, 1 << 17), torch.zeros(1, 1 << 17,
                                                                                                   dtype=torch.int8),
                                            torch.ones(1), None, 6.0)),
        ("zero-point rows", lambda: op(torch.empty(1, 1), torch.zeros(1, 1 << 16), torch.zeros(1, 1 << 16,
                                                                                             dtype=torch.int8),
                                       torch.ones(1), None, 6.0, True)),
    ]
    for match, fn in cases:
        with pytest.raises(RuntimeError, match=match):
            fn()
