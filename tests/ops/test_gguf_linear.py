"""gguf_linear: GGUF Q8_0 / Q4_0 / Q4_1 blocks multiplied natively, against the pure-torch reference and against
gguf-py's own `gguf.quants.dequantize` + a float64 matmul; every SIMD path (AVX-512, AVX2, scalar) and both CPU
paths (small-M weight streaming, M >= 9 dequantize-then-GEMM); bad input.

Tolerances (`check`): fp32 x -> the kernels dequantize exactly as gguf-py does and accumulate in fp32, so they
differ from the reference only in summation order: |diff| <= 2e-5 (abs and rel, scaled by sqrt(K / 32)).
bf16 x -> the output's bf16 rounding and, on the GEMM path, the weight's (2^-9 relative per weight): rtol 2e-2,
atol 2e-2 x rms(expected). On the CPU's small-M path with AVX-512 VNNI, bf16 x is quantized per block to int8
(like llama.cpp's q8 activations): error std ~0.6% and max ~2.6% of rms(expected) measured, so atol 5e-2 x rms.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagellm import ops
from pagellm.ops import reference
from ops.op_helpers import TOL, poison, requires_ops
from pagellm.quantization.gguf_packing import PACKED_FLAG, pack_rows, unpack_rows

gguf = pytest.importorskip("gguf")
pytestmark = requires_ops
OP = torch.ops.pagellm

QTYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3}
BLOCK_BYTES = {8: 34, 2: 18, 3: 20}


def random_blocks(n: int, k: int, qtype: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, k / 32 * block_bytes]: every quant byte random (all nibble / int8 values occur), fp16 d of
    either sign with |d| in [0.005, 0.05], Q4_1's fp16 m in [-0.5, 0.5]."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, BLOCK_BYTES[qtype]), generator=g, dtype=torch.uint8)
    sign = torch.randint(0, 2, (n, k // 32, 1), generator=g) * 2 - 1
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.045 + 0.005) * sign
    blocks[..., 0:2] = d.to(torch.float16).view(torch.uint8)
    if qtype == QTYPES["Q4_1"]:
        m = torch.rand(n, k // 32, 1, generator=g) - 0.5
        blocks[..., 2:4] = m.to(torch.float16).view(torch.uint8)
    return blocks.reshape(n, -1)


def gguf_py_dequantize(qweight: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    w = gguf.quants.dequantize(qweight.cpu().numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(qweight.shape[0], k)


def check(out: torch.Tensor, expected: torch.Tensor, k: int, int8_x: bool = False) -> None:
    """The tolerances of the module docstring; `int8_x`: half-precision x may have been quantized to int8."""
    full_precision = out.dtype == torch.float32
    out, expected = out.float().cpu(), expected.float().cpu()
    if full_precision:
        atol, rtol = TOL[torch.float32]
        scale = (k / 32) ** 0.5
        torch.testing.assert_close(out, expected, atol=atol * scale, rtol=rtol * scale)
    else:
        atol, rtol = TOL[torch.bfloat16]
        rms = expected.pow(2).mean().sqrt().item()
        torch.testing.assert_close(out, expected, atol=(5e-2 if int8_x else atol) * rms, rtol=rtol)


def int8_x_possible(x: torch.Tensor) -> bool:
    """Whether the CPU small-M path may quantize x to int8 (half dtype, M below the GEMM threshold of 16)."""
    return x.is_cpu and x.dtype != torch.float32 and x.shape[0] < 16


@pytest.mark.parametrize("qtype_name", list(QTYPES))
def test_reference_dequantize_matches_gguf_py(qtype_name):
    qtype = QTYPES[qtype_name]
    qw = random_blocks(7, 32 * 5, qtype, seed=3)
    assert torch.equal(reference.gguf_dequantize(qw, qtype, 32 * 5), gguf_py_dequantize(qw, qtype, 32 * 5))
    # blocks written by gguf-py's own quantizer, too
    w = np.random.default_rng(0).standard_normal((7, 32 * 5)).astype(np.float32)
    qw = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)))
    assert torch.equal(reference.gguf_dequantize(qw, qtype, 32 * 5), gguf_py_dequantize(qw, qtype, 32 * 5))


@pytest.mark.parametrize("qtype_name", list(QTYPES))
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_gguf_linear_matches_reference_and_gguf_py(qtype_name, m, dtype, with_bias, device):
    qtype = QTYPES[qtype_name]
    for n, k in ((37, 32 * 7), (5, 32), (129, 32 * 33)):  # N odd (tiles of 4 rows + tail), K = 32 * odd
        qw = random_blocks(n, k, qtype, seed=n + k).to(device)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(device)
        bias = torch.randn(n).to(dtype).to(device) if with_bias else None
        out = poison(torch.empty(m, n, dtype=dtype, device=device))
        ops.gguf_linear(out, x, qw, qtype, k, bias)

        expected = torch.empty_like(out)
        reference.gguf_linear(expected, x, qw, qtype, k, bias)
        check(out, expected, k, int8_x_possible(x))
        w64 = gguf_py_dequantize(qw, qtype, k).double()
        exact = x.cpu().double() @ w64.T + (0 if bias is None else bias.cpu().double())
        check(out, exact.float(), k, int8_x_possible(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m", [2, 12])
def test_strided_x_and_fp16(dtype, m, device):
    """x a column window of a wider buffer (row stride > K); float16 activations too."""
    k, n = 32 * 3, 11
    qw = random_blocks(n, k, QTYPES["Q4_1"], seed=5).to(device)
    buf = torch.randn(m, k + 40).to(dtype).to(device)
    x = buf[:, 8 : 8 + k]
    out = poison(torch.empty(m, n, dtype=dtype, device=device))
    OP.gguf_linear(out, x, qw, QTYPES["Q4_1"], k, None)
    expected = torch.empty_like(out)
    reference.gguf_linear(expected, x.contiguous(), qw, QTYPES["Q4_1"], k)
    check(out, expected, k, int8_x_possible(x))


_ISA_SCRIPT = r"""
import torch, sys
sys.path.insert(0, {tests!r})
from ops.test_gguf_linear import QTYPES, random_blocks, check
from pagellm.ops import reference
from pagellm.quantization.gguf_packing import PACKED_FLAG, pack_rows
int8_x = {int8_x}
for qtype in QTYPES.values():
    for m in (1, 2, 3, 5, 8, 15):
        for dtype in (torch.float32, torch.bfloat16):
            n, k = 13, 32 * 9
            qw = random_blocks(n, k, qtype, seed=m)
            x = torch.randn(m, k).to(dtype)
            bias = torch.randn(n).to(dtype)
            out = torch.full((m, n), float("nan"), dtype=dtype)
            torch.ops.pagellm.gguf_linear(out, x, qw, qtype, k, bias)
            expected = torch.empty_like(out)
            reference.gguf_linear(expected, x, qw, qtype, k, bias)
            check(out, expected, k, int8_x and dtype != torch.float32)
# the row-packed layout (qtype | 0x100): 2 groups of 16 rows + a tail of 7; M = 20 takes the GEMM path
for qtype in QTYPES.values():
    n, k = 39, 32 * 5
    qw = random_blocks(n, k, qtype, seed=qtype)
    packed = pack_rows(qw, qtype)
    for m in (1, 3, 15, 20):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(m, k).to(dtype)
            bias = torch.randn(n).to(dtype)
            out = torch.full((m, n), float("nan"), dtype=dtype)
            torch.ops.pagellm.gguf_linear(out, x, packed, qtype | PACKED_FLAG, k, bias)
            expected = torch.empty_like(out)
            reference.gguf_linear(expected, x, qw, qtype, k, bias)
            check(out, expected, k, int8_x and dtype != torch.float32 and m < 16)
print("ok")
"""


def _run_with_isa(isa: str, script: str = _ISA_SCRIPT) -> subprocess.CompletedProcess:
    """`script` (formatted with the tests directory and whether x may be quantized) in a fresh process."""
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PAGELLM_GGUF_CPU_ISA=isa)
    script = script.format(tests=tests_dir, int8_x=isa == "avx512_vnni")
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


@pytest.mark.parametrize("isa,flag", [("scalar", None), ("avx2", "avx2"), ("avx512", "avx512bw"),
                                      ("avx512_vnni", "avx512_vnni")])
def test_each_simd_path(isa, flag):
    """Every small-M path, each forced by PAGELLM_GGUF_CPU_ISA in a fresh process (the op picks the widest one
    the CPU has, once); avx512 and below keep bf16 x exact (fp32 FMA), avx512_vnni quantizes it to int8."""
    if flag is not None and flag not in _cpu_flags():
        pytest.skip(f"this CPU lacks {flag}")
    r = _run_with_isa(isa)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def check_row_packing(qtype: int, shapes, make_blocks) -> None:
    """pack_rows moves bytes only (unpack gives the file back, whole or by row ids); the packed op for every
    (n, k) of `shapes` at M 1 / 3 / 15 (small-M) and 17 (GEMM), fp32 and bf16, against gguf-py's dequantization.
    `make_blocks(n, k, qtype, seed)`: random blocks of the type."""
    for n, k in shapes:
        qw = make_blocks(n, k, qtype, seed=n)
        packed = pack_rows(qw, qtype)
        assert packed.shape == qw.shape
        assert torch.equal(packed, qw) == (n < 16)  # fewer than 16 rows: all tail, left in the file's layout
        assert torch.equal(unpack_rows(packed, qtype), qw)
        ids = torch.tensor([n - 1, 0, n // 2, n - 1])
        assert torch.equal(unpack_rows(packed, qtype, ids), qw[ids])
        w64 = gguf_py_dequantize(qw, qtype, k).double()
        for m in (1, 3, 15, 17):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
                out = poison(torch.empty(m, n, dtype=dtype))
                OP.gguf_linear(out, x, packed, qtype | PACKED_FLAG, k, None)
                check(out, (x.double() @ w64.T).float(), k, int8_x_possible(x))


@pytest.mark.parametrize("qtype_name", list(QTYPES))
def test_row_packing_round_trips_and_matches_gguf_py(qtype_name):
    """check_row_packing at N = 16 (one group), 53 (groups + a tail), 7 (all tail)."""
    check_row_packing(QTYPES[qtype_name], ((16, 32), (53, 32 * 3), (7, 64)), random_blocks)


def test_packed_layout_is_refused_where_it_does_not_apply():
    qw = random_blocks(16, 32, QTYPES["Q4_1"])
    with pytest.raises(ValueError, match="qtype must be one of"):
        pack_rows(qw, 5)
    with pytest.raises(ValueError, match=r"qweight must be uint8"):
        pack_rows(qw.float(), QTYPES["Q4_1"])
    with pytest.raises(RuntimeError, match="qtype must be"):
        OP.gguf_linear(torch.empty(1, 16), torch.randn(1, 32), qw, 5 | PACKED_FLAG, 32, None)


def test_bad_isa_override_is_an_error():
    r = _run_with_isa("sse9")
    assert r.returncode != 0 and "PAGELLM_GGUF_CPU_ISA must be scalar, avx2, avx512 or avx512_vnni" in r.stderr


def test_python_wrapper_errors():
    qw = random_blocks(4, 64, QTYPES["Q8_0"])
    x, out = torch.randn(2, 64), torch.empty(2, 4)
    with pytest.raises(ValueError, match=r"in_features must be a positive multiple of 32"):
        ops.gguf_linear(out, torch.randn(2, 48), qw, QTYPES["Q8_0"], 48)
    with pytest.raises(ValueError, match=r"qweight shape \(4, 68\) must be \[N, 40\]"):
        ops.gguf_linear(out, x, qw, QTYPES["Q4_1"], 64)
    with pytest.raises(ValueError, match=r"qtype must be one of \[2, 3, 8, 12, 14\]"):
        ops.gguf_linear(out, x, qw, 13, 64)
    with pytest.raises(TypeError, match="qweight must have dtype torch.uint8"):
        ops.gguf_linear(out, x, qw.to(torch.int8), QTYPES["Q8_0"], 64)
    with pytest.raises(ValueError, match="out shape"):
        ops.gguf_linear(torch.empty(2, 5), x, qw, QTYPES["Q8_0"], 64)


def test_cpp_errors_name_the_argument():
    qw = random_blocks(4, 64, QTYPES["Q8_0"])
    x, out = torch.randn(2, 64), torch.empty(2, 4)
    cases = [
        ("in_features must be a positive multiple of 32", lambda: OP.gguf_linear(out, torch.randn(2, 48), qw[:, :51].contiguous(), 8, 48, None)),
        (r"qweight must have shape \[N, in_features / 32 \* 20 = 40\]", lambda: OP.gguf_linear(out, x, qw, 3, 64, None)),
        (r"qtype must be 2 \(Q4_0\), 3 \(Q4_1\), 8 \(Q8_0\), 12 \(Q4_K\) or 14 \(Q6_K\).*, got 13",
         lambda: OP.gguf_linear(out, x, qw, 13, 64, None)),
        (r"x must have shape \[M, in_features = 96\]", lambda: OP.gguf_linear(out, x, qw, 8, 96, None)),
        ("qweight must have dtype", lambda: OP.gguf_linear(out, x, qw.view(torch.int8), 8, 64, None)),
        ("bias must have shape", lambda: OP.gguf_linear(out, x, qw, 8, 64, torch.randn(5))),
        ("out must have shape", lambda: OP.gguf_linear(torch.empty(3, 4), x, qw, 8, 64, None)),
        ("qweight must be contiguous", lambda: OP.gguf_linear(out, x, torch.cat([qw, qw], 1)[:, ::2], 8, 64, None)),
    ]
    for pattern, fn in cases:
        with pytest.raises(RuntimeError, match=pattern):
            fn()
