"""gguf_linear on GGUF's k-quants (Q4_K, Q6_K: super-blocks of 256): the pure-torch reference against gguf-py's
`gguf.quants.dequantize` (bit for bit), the op against the reference and a float64 matmul of gguf-py's weights on
random blocks at odd sizes (K = 256 x odd, odd N, M = 1 / 3 / 17 / 64: small-M and GEMM paths), every forced SIMD
path, opcheck, and bad input; the same for the row-packed layout (qtype | 0x100: pack / unpack round trip, the
packed op against gguf-py at N = 16 / 53 / 7, i.e. whole groups and tails, and against the file-layout kernel).

Tolerances: those of test_gguf_linear.check (fp32: summation order only; bf16: the output's rounding and, on the
GEMM path, the weight's; the small-M path on AVX-512 VNNI quantizes half-precision x to int8 per 32-block like for
the 32-element types: their int8 tolerance).
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from pagellm import ops
from pagellm.ops import reference
from ops.gguf_k_blocks import Q4_K, Q6_K, quantize_k, random_k_blocks
from ops.op_helpers import poison, requires_ops
from ops.test_gguf_linear import (
    _cpu_flags,
    _run_with_isa,
    check,
    check_row_packing,
    gguf_py_dequantize,
    int8_x_possible,
)
from pagellm.quantization.gguf_packing import PACKED_FLAG, pack_rows

gguf = pytest.importorskip("gguf")
pytestmark = requires_ops
OP = torch.ops.pagellm
K_QTYPES = {"Q4_K": Q4_K, "Q6_K": Q6_K}


@pytest.mark.parametrize("qtype_name", list(K_QTYPES))
def test_reference_dequantize_matches_gguf_py(qtype_name):
    qtype = K_QTYPES[qtype_name]
    for seed in range(3):
        qw = random_k_blocks(7, 256 * 3, qtype, seed=seed)
        assert torch.equal(reference.gguf_dequantize(qw, qtype, 256 * 3), gguf_py_dequantize(qw, qtype, 256 * 3))
    # blocks of a quantized weight (the test quantizer): gguf-py reads them as approximately that weight
    w = np.random.default_rng(0).standard_normal((5, 512)).astype(np.float32) * 0.05
    qw = torch.from_numpy(quantize_k(w, qtype))
    deq = reference.gguf_dequantize(qw, qtype, 512)
    assert torch.equal(deq, gguf_py_dequantize(qw, qtype, 512))
    assert (deq - torch.from_numpy(w)).abs().mean() < 0.15 * np.abs(w).mean()


@pytest.mark.parametrize("qtype_name", list(K_QTYPES))
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_gguf_linear_matches_reference_and_gguf_py(qtype_name, m, dtype, with_bias, device):
    qtype = K_QTYPES[qtype_name]
    for n, k in ((37, 256 * 3), (5, 256), (67, 256 * 5)):  # N odd (tiles of 4 rows + tail), K = 256 x odd
        qw = random_k_blocks(n, k, qtype, seed=n + k).to(device)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(device)
        bias = torch.randn(n).to(dtype).to(device) if with_bias else None
        out = poison(torch.empty(m, n, dtype=dtype, device=device))
        ops.gguf_linear(out, x, qw, qtype, k, bias)

        expected = torch.empty_like(out)
        reference.gguf_linear(expected, x, qw, qtype, k, bias)
        int8_x = int8_x_possible(x)
        check(out, expected, k, int8_x)
        w64 = gguf_py_dequantize(qw, qtype, k).double()
        exact = x.cpu().double() @ w64.T + (0 if bias is None else bias.cpu().double())
        check(out, exact.float(), k, int8_x)


def test_strided_x_and_fp16(device):
    """x a column window of a wider buffer (row stride > K), float16 activations."""
    k, n = 512, 11
    for qtype in K_QTYPES.values():
        qw = random_k_blocks(n, k, qtype, seed=5).to(device)
        x = torch.randn(6, k + 40).to(torch.float16).to(device)[:, 8 : 8 + k]
        out = poison(torch.empty(6, n, dtype=torch.float16, device=device))
        OP.gguf_linear(out, x, qw, qtype, k, None)
        expected = torch.empty_like(out)
        reference.gguf_linear(expected, x.contiguous(), qw, qtype, k)
        check(out, expected, k, int8_x_possible(x))


_K_ISA_SCRIPT = r"""
import torch, sys
sys.path.insert(0, {tests!r})
from ops.gguf_k_blocks import Q4_K, Q6_K, random_k_blocks
from ops.test_gguf_linear import check
from pagellm.ops import reference
from pagellm.quantization.gguf_packing import PACKED_FLAG, pack_rows
for qtype in (Q4_K, Q6_K):
    for m in (1, 2, 3, 5, 8, 15, 20):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            n, k = 13, 256 * 3
            qw = random_k_blocks(n, k, qtype, seed=m)
            x = torch.randn(m, k).to(dtype)
            bias = torch.randn(n).to(dtype)
            out = torch.full((m, n), float("nan"), dtype=dtype)
            torch.ops.pagellm.gguf_linear(out, x, qw, qtype, k, bias)
            expected = torch.empty_like(out)
            reference.gguf_linear(expected, x, qw, qtype, k, bias)
            check(out, expected, k, {int8_x} and dtype != torch.float32 and m < 16)
# the row-packed layout: 2 groups of 16 rows + a tail of 5; M = 20 takes the GEMM path
for qtype in (Q4_K, Q6_K):
    n, k = 37, 256 * 3
    qw = random_k_blocks(n, k, qtype, seed=qtype)
    packed = pack_rows(qw, qtype)
    for m in (1, 3, 15, 20):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(m, k).to(dtype)
            bias = torch.randn(n).to(dtype)
            out = torch.full((m, n), float("nan"), dtype=dtype)
            torch.ops.pagellm.gguf_linear(out, x, packed, qtype | PACKED_FLAG, k, bias)
            expected = torch.empty_like(out)
            reference.gguf_linear(expected, x, qw, qtype, k, bias)
            check(out, expected, k, {int8_x} and dtype != torch.float32 and m < 16)
print("ok")
"""


@pytest.mark.parametrize("isa,flag", [("scalar", None), ("avx2", "avx2"), ("avx512", "avx512bw"),
                                      ("avx512_vnni", "avx512_vnni")])
def test_each_simd_path(isa, flag):
    """Every small-M path (and the GEMM path's dequantization, M = 20), forced by PAGELLM_GGUF_CPU_ISA in a fresh
    process; on avx512_vnni half-precision x is quantized to int8 (the k-quants' VNNI tiles, the packed layout's
    VNNI kernels); elsewhere a packed weight is unpacked tile by tile."""
    if flag is not None and flag not in _cpu_flags():
        pytest.skip(f"this CPU lacks {flag}")
    r = _run_with_isa(isa, _K_ISA_SCRIPT)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("qtype_name", list(K_QTYPES))
def test_opcheck(qtype_name):
    qtype = K_QTYPES[qtype_name]
    qw = random_k_blocks(24, 512, qtype, seed=2)
    packed = pack_rows(qw, qtype)
    for m in (3, 17):
        for dtype in (torch.float32, torch.bfloat16):
            x, bias = torch.randn(m, 512).to(dtype), torch.randn(24).to(dtype)
            torch.library.opcheck(OP.gguf_linear.default, (torch.empty(m, 24, dtype=dtype), x, qw, qtype, 512, bias))
            torch.library.opcheck(OP.gguf_linear.default,
                                  (torch.empty(m, 24, dtype=dtype), x, packed, qtype | PACKED_FLAG, 512, bias))


@pytest.mark.parametrize("qtype_name", list(K_QTYPES))
def test_row_packing_round_trips_and_matches_gguf_py(qtype_name):
    """check_row_packing at N = 16 (one group), 53 (3 groups + a tail of 5), 7 (all tail); K = 256 x odd."""
    check_row_packing(K_QTYPES[qtype_name], ((16, 256), (53, 256 * 3), (7, 256 * 5)), random_k_blocks)


@pytest.mark.parametrize("qtype_name", list(K_QTYPES))
def test_packed_kernel_matches_file_layout_kernel(qtype_name):
    """The packed VNNI kernel's integer dots are the file-layout VNNI tiles' (the same int8 x, the same weights):
    only the fp32 summation order differs, so with fp16 outputs (3 more mantissa bits than bf16) the two agree to
    about fp16's rounding. Without VNNI both paths dequantize the same rows (packed: unpacked tile by tile)."""
    qtype = K_QTYPES[qtype_name]
    n, k = 48, 256 * 7
    qw = random_k_blocks(n, k, qtype, seed=11)
    packed = pack_rows(qw, qtype)
    for m in (1, 4, 7):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.float16)
        out, ref = torch.empty(m, n, dtype=torch.float16), torch.empty(m, n, dtype=torch.float16)
        OP.gguf_linear(out, x, packed, qtype | PACKED_FLAG, k, None)
        OP.gguf_linear(ref, x, qw, qtype, k, None)
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=1e-4 * scale)


def test_bad_input_names_the_block_size():
    qw = random_k_blocks(4, 256, Q4_K)
    x, out = torch.randn(2, 256), torch.empty(2, 4)
    with pytest.raises(ValueError, match=r"positive multiple of 256 \(the block size of qtype 12\)"):
        ops.gguf_linear(out, torch.randn(2, 96), qw[:, :54].contiguous(), Q4_K, 96)
    with pytest.raises(ValueError, match=r"qweight shape \(4, 144\) must be \[N, 210\]"):
        ops.gguf_linear(out, x, qw, Q6_K, 256)
    cases = [
        (r"in_features must be a positive multiple of 256 \(the block size of qtype 14\), got 96",
         lambda: OP.gguf_linear(out, torch.randn(2, 96), qw, Q6_K, 96, None)),
        (r"qweight must have shape \[N, in_features / 256 \* 210 = 210\]",
         lambda: OP.gguf_linear(out, x, qw, Q6_K, 256, None)),
        (r"qtype must be .*12 \(Q4_K\) or 14 \(Q6_K\).*got 269",  # no type 13, packed or not
         lambda: OP.gguf_linear(out, x, qw, 13 | 0x100, 256, None)),
    ]
    for pattern, fn in cases:
        with pytest.raises(RuntimeError, match=pattern):
            fn()
    with pytest.raises(ValueError, match=r"qweight must be uint8 \[N, K / 256 \* 210\]"):
        pack_rows(qw, Q6_K)  # 144-byte Q4_K rows are not whole Q6_K blocks
