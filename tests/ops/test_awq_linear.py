"""awq_linear: AWQ 4-bit group-quantized weights (qweight uint8 [N, K / 2] in the kernel layout of
`quantization.awq_format`, scales float32 / zeros uint8 [N, K / G]) multiplied natively, against the pure-torch
reference and a float64 matmul of the weight dequantized from the unpacked integers; every CPU SIMD path
(AVX-512 VNNI, AVX-512, AVX2, scalar, forced by PAGELLM_AWQ_CPU_ISA) and both CPU paths (small-M weight
streaming, M >= 16 dequantize-then-GEMM); odd N, K = 32 * odd, group sizes 32 / 64 / 96 / 128 / 256; replay from
a step graph; bad input.

Tolerances (`check`): the kernels expand every weight exactly ((q - z) as an integer, one product by s) and
accumulate in fp32. fp32 x -> they differ from the reference only in summation order: |diff| <= 2e-5 (abs and rel,
scaled by sqrt(K / 32)). bf16 / fp16 x -> the small-M path converts x to fp32, so only the output's rounding
differs (<= 1 ulp); the GEMM path (M >= 16) also rounds the weight to x's dtype before torch's GEMM (2^-9 / 2^-12
relative per weight): rtol and atol x rms(expected) of TOL[dtype] (bf16 2e-2, fp16 2e-3).

int8 activations (`int8_x`): on a CPU with AVX-512 VNNI the small-M path quantizes bf16 / fp16 x per (row,
32-block) to int8 (dx = max|x| / 127), so each x element moves by up to dx / 2 (uniform: std dx / sqrt(12));
for randn x (block max ~2.3) that is ~0.5% of rms(x), and the output error, a sum of such terms weighted by the
weights, has std ~0.5% of rms(expected) (measured 0.3-1.2% on the shapes below, max 3.5% with the output's
own rounding): atol 5e-2 x rms(expected), about 10 sigma, as tests/ops/test_gguf_linear.py. The VNNI path is
also checked tightly, against the same int8 rounding done in torch then a float64 matmul (`int8_activations`):
there only fp32 summation order and the output's rounding remain, the TOL[dtype] tolerances.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagellm import ops
from pagellm.ops import reference
from pagellm.quantization import awq_format
from ops.op_helpers import TOL, poison, requires_ops

pytestmark = requires_ops
OP = torch.ops.pagellm
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
# (N, K, group_size): N odd (tiles of 4 rows + tail, and N = 1), K = 32 * odd where the group allows
SHAPES = [(37, 96, 32), (1, 160, 32), (129, 416, 32), (37, 192, 64), (5, 384, 128), (13, 640, 128)]


def random_awq(n: int, k: int, group_size: int, seed: int = 0):
    """(q uint8 [n, k] in 0..15, qweight uint8 [n, k / 2] (kernel layout), scales float32 of either sign with
    |s| in [0.002, 0.02], zeros uint8 in 0..15 [n, k / group_size])."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    sign = torch.randint(0, 2, (n, k // group_size), generator=g) * 2 - 1
    scales = (torch.rand(n, k // group_size, generator=g) * 0.018 + 0.002) * sign
    zeros = torch.randint(0, 16, (n, k // group_size), generator=g, dtype=torch.uint8)
    return q, awq_format.pack_kernel_int4(q), scales.float(), zeros


def exact_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """float64 W [n, k] = (q - z) * s, straight from the unpacked integers."""
    z = zeros.double().repeat_interleave(group_size, dim=1)
    return (q.double() - z) * scales.double().repeat_interleave(group_size, dim=1)


def check(out: torch.Tensor, expected: torch.Tensor, k: int, int8_x: bool = False) -> None:
    """The tolerances of the module docstring; `int8_x`: half-precision x may have been quantized to int8."""
    out, expected, dtype = out.float().cpu(), expected.float().cpu(), out.dtype
    atol, rtol = TOL[dtype]
    if dtype == torch.float32:
        scale = (k / 32) ** 0.5
        torch.testing.assert_close(out, expected, atol=atol * scale, rtol=rtol * scale)
    else:
        rms = expected.pow(2).mean().sqrt().item()
        torch.testing.assert_close(out, expected, atol=(5e-2 if int8_x else atol) * rms, rtol=rtol)


def int8_x_possible(x: torch.Tensor) -> bool:
    """Whether the CPU small-M path may quantize x to int8 (half dtype, M below the GEMM threshold of 16)."""
    return x.is_cpu and x.dtype != torch.float32 and x.shape[0] < 16


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """float64 [M, K]: x rounded as the VNNI path does, per (row, 32-block) in fp32: dx = max|x| / 127,
    q = round-half-even(x * (1 / dx)) (0 for an all-zero block), x ~ q * dx."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    q = torch.round(xb * inv).clamp(-128, 127)
    return (q.double() * dx.double()).reshape(x.shape)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_reference_dequantize(group_size):
    """The reference reads the kernel layout exactly as awq_format packs it, and an AutoAWQ checkpoint layer
    repacked by awq_to_kernel_layout dequantizes to the same weight as awq_format.dequantize_awq."""
    q, qweight, scales, zeros = random_awq(9, 3 * 128, group_size, seed=group_size)
    w = reference.awq_dequantize(qweight, scales, zeros, group_size)
    assert w.dtype == torch.float32
    assert torch.equal(w, exact_weight(q, scales, zeros, group_size).float())
    assert torch.equal(awq_format.unpack_kernel_int4(qweight), q)

    weight = torch.randn(16, 3 * 128, generator=torch.Generator().manual_seed(1))
    ckpt = awq_format.quantize_awq(weight, group_size)
    kernel = awq_format.awq_to_kernel_layout(*ckpt, group_size)
    assert torch.equal(reference.awq_dequantize(*kernel, group_size), awq_format.dequantize_awq(*ckpt, group_size))


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_awq_linear_matches_reference(m, dtype, with_bias, device):
    for n, k, group_size in SHAPES:
        q, qweight, scales, zeros = random_awq(n, k, group_size, seed=n + k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        bias = torch.randn(n).to(dtype) if with_bias else None
        args = [t.to(device) for t in (x, qweight, scales, zeros)]
        bias_d = None if bias is None else bias.to(device)
        out = poison(torch.empty(m, n, dtype=dtype, device=device))
        ops.awq_linear(out, *args[:4], group_size, bias_d)

        expected = torch.empty(m, n, dtype=dtype)
        reference.awq_linear(expected, x, qweight, scales, zeros, group_size, bias)
        check(out, expected, k, int8_x_possible(args[0]))
        exact = x.double() @ exact_weight(q, scales, zeros, group_size).T + (0 if bias is None else bias.double())
        check(out, exact.float(), k, int8_x_possible(args[0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m", [2, 12, 20])
def test_strided_x(dtype, m, device):
    """x a column window of a wider buffer (row stride > K), on both CPU paths."""
    n, k, group_size = 11, 96, 32
    _, qweight, scales, zeros = random_awq(n, k, group_size, seed=5)
    buf = torch.randn(m, k + 40).to(dtype)
    x = buf[:, 8 : 8 + k]
    out = poison(torch.empty(m, n, dtype=dtype, device=device))
    OP.awq_linear(out, x.to(device), qweight.to(device), scales.to(device), zeros.to(device), group_size, None)
    expected = torch.empty(m, n, dtype=dtype)
    reference.awq_linear(expected, x.contiguous(), qweight, scales, zeros, group_size)
    check(out, expected, k, int8_x_possible(x.to(device)))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gemm_path_spans_several_weight_tiles(dtype):
    """K = 4096: the CPU GEMM path expands ~1 MiB of weight rows at a time (64 fp32 / 128 half rows), so N = 129
    is several tiles and a one-row tail, each with its slice of the bias."""
    n, k, group_size, m = 129, 4096, 128, 20
    q, qweight, scales, zeros = random_awq(n, k, group_size, seed=7)
    x, bias = torch.randn(m, k).to(dtype), torch.randn(n).to(dtype)
    out = poison(torch.empty(m, n, dtype=dtype))
    ops.awq_linear(out, x, qweight, scales, zeros, group_size, bias)
    expected = torch.empty_like(out)
    reference.awq_linear(expected, x, qweight, scales, zeros, group_size, bias)
    check(out, expected, k)


def _default_isa_is_vnni() -> str | None:
    """None when this process's awq_linear takes the VNNI path for half x, else why not (a skip reason)."""
    missing = [f for f in AVX512 + ("avx512_vnni",) if f not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}: the VNNI path is never chosen"
    forced = os.environ.get("PAGELLM_AWQ_CPU_ISA", "")
    if forced not in ("", "vnni", "avx512_vnni"):
        return f"PAGELLM_AWQ_CPU_ISA={forced} narrows this process below the VNNI path"
    return None


# (N, K, G): N odd or 1; K = 32 * odd for G = 32 / 96, K = 64 * odd for G = 64, quads of 4 blocks with a partial
# last one (K / 32 = 3, 9, 13); G = 128 (a quad per group), 256 (two quads per group), G = K (10 blocks).
VNNI_SHAPES = [(37, 96, 32), (1, 416, 32), (13, 288, 96), (9, 192, 64), (5, 640, 128), (7, 1280, 256),
               (11, 320, 320)]


@pytest.mark.parametrize("m", [1, 3, 15])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_vnni_path_is_int8_activation_rounding_only(m, dtype):
    """The default CPU small-M path for half-precision x on a VNNI CPU: against the int8 rounding of x done in
    torch and a float64 matmul (TOL[dtype]), and against the reference within the int8-x tolerance."""
    reason = _default_isa_is_vnni()
    if reason:
        pytest.skip(reason)
    for n, k, group_size in VNNI_SHAPES:
        q, qweight, scales, zeros = random_awq(n, k, group_size, seed=m * n + k)
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3).to(dtype)
        bias = torch.randn(n).to(dtype)
        out = poison(torch.empty(m, n, dtype=dtype))
        OP.awq_linear(out, x, qweight, scales, zeros, group_size, bias)
        w = exact_weight(q, scales, zeros, group_size)
        check(out, (int8_activations(x) @ w.T + bias.double()).float(), k)
        expected = torch.empty_like(out)
        reference.awq_linear(expected, x, qweight, scales, zeros, group_size, bias)
        check(out, expected, k, int8_x=True)


def test_vnni_path_zero_and_constant_blocks():
    """All-zero blocks (dx = 0) contribute nothing; a constant block (every q = 127) meets the zero points
    exactly."""
    reason = _default_isa_is_vnni()
    if reason:
        pytest.skip(reason)
    n, k, group_size = 5, 320, 64
    q, qweight, scales, zeros = random_awq(n, k, group_size, seed=3)
    x = torch.randn(2, k).bfloat16()
    x[0, 64:160] = 0
    x[1, :] = 0.5
    out = poison(torch.empty(2, n, dtype=torch.bfloat16))
    OP.awq_linear(out, x, qweight, scales, zeros, group_size, None)
    exact = x.double() @ exact_weight(q, scales, zeros, group_size).T
    check(out[1:], exact[1:].float(), k)  # 0.5 is q = 127 exactly: no int8 rounding at all
    check(out, (int8_activations(x) @ exact_weight(q, scales, zeros, group_size).T).float(), k)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_replayed_from_a_step_graph(dtype):
    """awq_linear reads no Python values: captured once (out allocated inside), replayed on new x it equals the
    eager call bit for bit, on the path this CPU takes by default (VNNI for half x where available)."""
    from pagellm.step_graph import StepRecorder, build_step_graph  # noqa: PLC0415

    n, k, group_size = 13, 384, 128
    _, qweight, scales, zeros = random_awq(n, k, group_size, seed=9)
    bias = torch.randn(n).to(dtype)

    def step(ins):
        out = torch.empty(ins[0].shape[0], n, dtype=dtype)
        OP.awq_linear(out, ins[0], qweight, scales, zeros, group_size, bias)
        return out

    x = torch.randn(3, k).to(dtype)
    constants = {id(t) for t in (qweight, scales, zeros, bias)}
    recorder = StepRecorder([x], lambda t: id(t) in constants)
    with recorder:
        out = step([x])
    graph = build_step_graph(recorder.recording, [recorder.slot(out)])
    for seed in range(3):
        new = torch.randn(3, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
        assert torch.equal(graph.run([new])[0], step([new]))


def test_empty_m_writes_nothing():
    _, qweight, scales, zeros = random_awq(7, 64, 32)
    out = torch.empty(0, 7)
    ops.awq_linear(out, torch.empty(0, 64), qweight, scales, zeros, 32)
    assert out.shape == (0, 7)


_ISA_SCRIPT = r"""
import torch, sys
sys.path.insert(0, {tests!r})
from ops.test_awq_linear import random_awq, check, exact_weight, int8_activations
from pagellm.ops import reference
vnni = {vnni}
for m in {ms}:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n, k, group_size in ((13, 288, 32), (6, 192, 64), (3, 384, 128), (5, 288, 96)):
            q, qweight, scales, zeros = random_awq(n, k, group_size, seed=m)
            x = torch.randn(m, k).to(dtype)
            bias = torch.randn(n).to(dtype)
            out = torch.full((m, n), float("nan"), dtype=dtype)
            torch.ops.pagellm.awq_linear(out, x, qweight, scales, zeros, group_size, bias)
            expected = torch.empty_like(out)
            reference.awq_linear(expected, x, qweight, scales, zeros, group_size, bias)
            int8_x = vnni and dtype != torch.float32
            check(out, expected, k, int8_x)
            if int8_x:  # exactly the int8 rounding: only summation order and the output's rounding remain
                w = exact_weight(q, scales, zeros, group_size)
                check(out, (int8_activations(x) @ w.T + bias.double()).float(), k)
print("ok")
"""


def _run_with_isa(isa: str, ms: tuple[int, ...] = (1, 2, 3, 4, 5, 8, 15)) -> subprocess.CompletedProcess:
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PAGELLM_AWQ_CPU_ISA=isa)
    script = _ISA_SCRIPT.format(tests=tests_dir, vnni=isa in ("vnni", "avx512_vnni"), ms=ms)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


@pytest.mark.parametrize("isa,flags", [("scalar", ()), ("avx2", ("avx2", "fma")), ("avx512", AVX512),
                                       ("vnni", AVX512 + ("avx512_vnni",))])
def test_each_simd_path(isa, flags):
    """Every small-M path (M = 1 .. 15: MR-row tiles and their tails), each forced by PAGELLM_AWQ_CPU_ISA in a
    fresh process (the op picks the widest one the CPU has, once); avx512 and below keep half-precision x exact
    (fp32 FMA), vnni quantizes it to int8 and is also checked against that rounding done in torch (in fp16 the
    exact path would miss that tolerance, so the check tells the paths apart); fp32 x stays exact everywhere."""
    missing = [f for f in flags if f not in _cpu_flags()]
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}")
    r = _run_with_isa(isa)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_avx512_vnni_is_an_alias_of_vnni():
    """gguf_linear's name for the path (PAGELLM_GGUF_CPU_ISA=avx512_vnni) selects it here too (M = 1 only)."""
    missing = [f for f in AVX512 + ("avx512_vnni",) if f not in _cpu_flags()]
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}")
    r = _run_with_isa("avx512_vnni", ms=(1,))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_bad_isa_override_is_an_error():
    r = _run_with_isa("sse9")
    assert r.returncode != 0 and "PAGELLM_AWQ_CPU_ISA must be scalar, avx2, avx512, vnni or avx512_vnni" in r.stderr


def test_python_wrapper_errors():
    _, qw, s, z = random_awq(4, 128, 64)
    x, out = torch.randn(2, 128), torch.empty(2, 4)
    with pytest.raises(ValueError, match=r"group_size must be a positive multiple of 32"):
        ops.awq_linear(out, x, qw, s, z, 48)
    with pytest.raises(ValueError, match=r"group_size \(128\) must divide K = 96 > 0"):
        ops.awq_linear(out, torch.randn(2, 96), qw[:, :48], s[:, :1], z[:, :1], 128)
    with pytest.raises(ValueError, match=r"qweight shape \(4, 64\) must be \(4, 80\)"):
        ops.awq_linear(out, torch.randn(2, 160), qw, s, z, 32)
    with pytest.raises(ValueError, match=r"scales shape \(4, 2\) must be \(4, 4\)"):
        ops.awq_linear(out, x, qw, s, z, 32)
    with pytest.raises(TypeError, match="qweight must have dtype torch.uint8"):
        ops.awq_linear(out, x, qw.view(torch.int8), s, z, 64)
    with pytest.raises(TypeError, match="scales must have dtype torch.float32"):
        ops.awq_linear(out, x, qw, s.half(), z, 64)
    with pytest.raises(TypeError, match="zeros must have dtype torch.uint8"):
        ops.awq_linear(out, x, qw, s, z.int(), 64)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        ops.awq_linear(out, x.double(), qw, s, z, 64)
    with pytest.raises(TypeError, match="out must have the dtype of x"):
        ops.awq_linear(out.half(), x, qw, s, z, 64)
    with pytest.raises(ValueError, match="out shape"):
        ops.awq_linear(torch.empty(2, 5), x, qw, s, z, 64)
    with pytest.raises(ValueError, match="bias shape"):
        ops.awq_linear(out, x, qw, s, z, 64, torch.randn(5))


def test_cpp_errors_name_the_argument():
    _, qw, s, z = random_awq(4, 128, 64)
    x, out = torch.randn(2, 128), torch.empty(2, 4)
    cases = [
        ("group_size must be a positive multiple of 32", lambda: OP.awq_linear(out, x, qw, s, z, 0, None)),
        (r"group_size \(128\) must divide K = 96", lambda: OP.awq_linear(out, torch.randn(2, 96), qw[:, :48], s[:, :1],
                                                                          z[:, :1], 128, None)),
        ("K = 80 .* must be a positive multiple of 32", lambda: OP.awq_linear(out, torch.randn(2, 80), qw, s, z, 32, None)),
        (r"qweight must have shape \[N, K / 2 = 64\]", lambda: OP.awq_linear(out, x, qw[:, :32], s, z, 64, None)),
        (r"scales must have shape \[N, K / group_size\] = \[4, 4\]", lambda: OP.awq_linear(out, x, qw, s, z, 32, None)),
        (r"zeros must have shape \[N, K / group_size\] = \[4, 2\]", lambda: OP.awq_linear(out, x, qw, s, z[:, :1], 64, None)),
        ("qweight must have dtype", lambda: OP.awq_linear(out, x, qw.view(torch.int8), s, z, 64, None)),
        ("scales must have dtype", lambda: OP.awq_linear(out, x, qw, s.half(), z, 64, None)),
        ("zeros must have dtype", lambda: OP.awq_linear(out, x, qw, s, z.int(), 64, None)),
        ("out must have the same dtype as x", lambda: OP.awq_linear(out.half(), x, qw, s, z, 64, None)),
        ("bias must have shape", lambda: OP.awq_linear(out, x, qw, s, z, 64, torch.randn(5))),
        ("out must have shape", lambda: OP.awq_linear(torch.empty(3, 4), x, qw, s, z, 64, None)),
        ("scales must be contiguous", lambda: OP.awq_linear(out, x, qw, torch.cat([s, s], 1)[:, ::2], z, 64, None)),
        ("qweight must be contiguous", lambda: OP.awq_linear(out, x, torch.cat([qw, qw], 1)[:, ::2], s, z, 64, None)),
    ]
    for pattern, fn in cases:
        with pytest.raises(RuntimeError, match=pattern):
            fn()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_opcheck_half_x_small_m(dtype):
    """opcheck (schema, fake, aot dispatch) on the path half x takes at M < 16 (VNNI where the CPU has it);
    test_opcheck_errors.py covers fp32 x."""
    _, qweight, scales, zeros = random_awq(9, 192, 64, seed=4)
    x = torch.randn(3, 192).to(dtype)
    out = torch.empty(3, 9, dtype=dtype)
    torch.library.opcheck(OP.awq_linear.default, (out, x, qweight, scales, zeros, 64, torch.randn(9).to(dtype)))
