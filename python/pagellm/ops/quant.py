"""Validating wrappers of the quantized-weight matmuls: gguf_linear (GGUF blocks), awq_linear (AWQ int4 groups),
int8_linear (LLM.int8()). Re-exported by `pagellm.ops`; references in `pagellm.ops.reference`."""

from __future__ import annotations

import torch

from pagellm.ops.arg_checks import _dtype, _float, _ndim, _same, _tensor

# int8_linear with zero_point: |sum_k (q - z) w| <= 255 * 128 * K must fit int32
ZERO_POINT_MAX_K = 1 << 16

def gguf_linear(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, qtype: int, in_features: int,
                bias: torch.Tensor | None = None) -> None:
    """out [M, N] = x [M, K] @ dequant(qweight)^T (+ bias [N]), fp32 accumulation, one rounding into x's dtype.

    qweight: uint8 [N, K / block_elems * block_bytes] in GGUF's block layout (rows of a .gguf tensor as stored);
    qtype: the ggml type id, 2 (Q4_0), 3 (Q4_1), 8 (Q8_0), 12 (Q4_K) or 14 (Q6_K) (`reference.GGUF_QTYPES`);
    in_features = K, a multiple of the type's block size (32, or 256 for the k-quants). Reference:
    `reference.gguf_linear`."""
    from pagellm.ops.reference import GGUF_BLOCK_BYTES, GGUF_BLOCK_ELEMS, gguf_row_bytes  # noqa: PLC0415

    _float(x, "x")
    _dtype(qweight, torch.uint8, "qweight")
    _tensor(out, "out")
    _same(out, x, "out", "x")
    if bias is not None:
        _tensor(bias, "bias")
        _same(bias, x, "bias", "x")
    if qtype not in GGUF_BLOCK_BYTES:
        raise ValueError(f"qtype must be one of {sorted(GGUF_BLOCK_BYTES)} (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), "
                         f"got {qtype!r}")
    elems = GGUF_BLOCK_ELEMS[qtype]
    if not isinstance(in_features, int) or in_features <= 0 or in_features % elems:
        raise ValueError(f"in_features must be a positive multiple of {elems} (the block size of qtype {qtype}), "
                         f"got {in_features!r}")
    _ndim(x, 2, "x")
    _ndim(qweight, 2, "qweight")
    row_bytes = gguf_row_bytes(qtype, in_features)
    if x.shape[1] != in_features:
        raise ValueError(f"x shape {tuple(x.shape)} must be [M, in_features={in_features}]")
    if qweight.shape[1] != row_bytes:
        raise ValueError(f"qweight shape {tuple(qweight.shape)} must be [N, {row_bytes}] for qtype {qtype} "
                         f"and in_features {in_features}")
    if tuple(out.shape) != (x.shape[0], qweight.shape[0]):
        raise ValueError(f"out shape {tuple(out.shape)} must be {(x.shape[0], qweight.shape[0])}")
    torch.ops.pagellm.gguf_linear(out, x, qweight, int(qtype), int(in_features), bias)


def awq_linear(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, bias: torch.Tensor | None = None) -> None:
    """out [M, N] = x [M, K] @ W^T (+ bias [N]), W [N, K] = (q - zeros) * scales per group of `group_size` k
    (a multiple of 32 dividing K; K a multiple of 32). qweight uint8 [N, K / 2] in awq_linear's layout
    (`quantization.awq_format.pack_kernel_int4`), scales float32 and zeros uint8 (0..15) [N, K / group_size].
    fp32 accumulation, one rounding into x's dtype. Reference: `reference.awq_linear`."""
    _float(x, "x")
    for t, dtype, name in ((qweight, torch.uint8, "qweight"), (scales, torch.float32, "scales"),
                           (zeros, torch.uint8, "zeros")):
        _dtype(t, dtype, name)
        _ndim(t, 2, name)
    _tensor(out, "out")
    _same(out, x, "out", "x")
    if bias is not None:
        _tensor(bias, "bias")
        _same(bias, x, "bias", "x")
    _ndim(x, 2, "x")
    (m, k), n = x.shape, qweight.shape[0]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % 32:
        raise ValueError(f"group_size must be a positive multiple of 32 (32, 64, 128, ...), got {group_size!r}")
    if k == 0 or k % group_size:
        raise ValueError(f"group_size ({group_size}) must divide K = {k} > 0 (x shape {tuple(x.shape)})")
    expected = {"qweight": (n, k // 2), "scales": (n, k // group_size), "zeros": (n, k // group_size), "out": (m, n)}
    for t, name in ((qweight, "qweight"), (scales, "scales"), (zeros, "zeros"), (out, "out")):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"{name} shape {tuple(t.shape)} must be {expected[name]} for x {tuple(x.shape)}, "
                             f"N = {n}, group_size = {group_size}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias shape {tuple(bias.shape)} must be ({n},) (N)")
    torch.ops.pagellm.awq_linear(out, x, qweight, scales, zeros, int(group_size), bias)


def int8_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, threshold: float = 6.0, zero_point: bool = False,
                group_size: int = 0) -> None:
    """LLM.int8(): out [M, N] = x [M, K] @ (weight [N, K] int8 * weight_scale [N] float32)^T (+ bias [N]).

    Columns of x with |x| > threshold in any row run in fp32 against the dequantized weight; the rest are
    quantized per row to 8 bits and multiplied with the int8 weight into int32: by the row's absmax to int8
    (zero_point False, bitsandbytes' rule) or, zero_point True, asymmetrically over the row's [min, max] to uint8
    with an integer zero point (K < 65536); group_size > 0 (a multiple of 64, zero_point False): by the absmax of
    each group of group_size elements of K (vLLM's per-token-group rule), each group's int32 sum scaled in fp32.
    threshold 0 = no outlier columns. x, out, bias: float32 / bfloat16 /
    float16. Reference: `reference.int8_linear`."""
    _float(x, "x")
    _tensor(out, "out")
    _same(out, x, "out", "x")
    _dtype(weight, torch.int8, "weight")
    _dtype(weight_scale, torch.float32, "weight_scale")
    if bias is not None:
        _tensor(bias, "bias")
        _same(bias, x, "bias", "x")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(f"threshold must be a number >= 0 (0 = no outlier columns), got {threshold!r}")
    if not isinstance(zero_point, bool):
        raise TypeError(f"zero_point must be a bool, got {zero_point!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {group_size!r}")
    if group_size < 0 or group_size % 64:
        raise ValueError(f"group_size must be 0 (one scale per row) or a positive multiple of 64, got {group_size}")
    if group_size and zero_point:
        raise ValueError("group_size > 0 quantizes groups by their absmax: zero_point must be False")
    _ndim(x, 2, "x")
    _ndim(weight, 2, "weight")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} must be [N, {x.shape[1]}] (K of x)")
    if tuple(weight_scale.shape) != (weight.shape[0],):
        raise ValueError(f"weight_scale shape {tuple(weight_scale.shape)} must be ({weight.shape[0]},) (N)")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} must be ({weight.shape[0]},) (N)")
    if tuple(out.shape) != (x.shape[0], weight.shape[0]):
        raise ValueError(f"out shape {tuple(out.shape)} must be {(x.shape[0], weight.shape[0])}")
    if zero_point and x.shape[1] >= ZERO_POINT_MAX_K:
        raise ValueError(f"zero_point int8_linear needs K < {ZERO_POINT_MAX_K} (exact int32 sums), "
                         f"got K = {x.shape[1]}")
    torch.ops.pagellm.int8_linear(out, x, weight, weight_scale, bias, float(threshold), zero_point, group_size)
