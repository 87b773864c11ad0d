"""AutoAWQ's checkpoint layout ("gemm" version), read and written.

An AWQ linear layer with logical weight W [out, in] is stored transposed and packed, eight 4-bit values per
int32, along the output dim:

    qweight  int32   [in, out / 8]            q[k, n] in 0..15
    qzeros   int32   [in / group, out / 8]    z[g, n] in 0..15 (no offset, unlike GPTQ)
    scales   float16 [in / group, out]        s[g, n]
    W[n, k] = (q[k, n] - z[k // group, n]) * s[k // group, n]

Within each int32, nibble i (bits 4i .. 4i+3) holds output column 8 * c + AWQ_PACK_ORDER[i]: AutoAWQ
interleaves the columns (0, 2, 4, 6, 1, 3, 5, 7) to suit its CUDA dequantization. The config dict is
`{"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}`.

These helpers are pure torch and exact; the loader repacks into the kernel layout (`awq_linear`'s), and
`pagellm quantize --method awq` writes this layout.
"""

from __future__ import annotations

import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column 8c + AWQ_PACK_ORDER[i]
AWQ_PACK_FACTOR = 8  # 4-bit values per int32


def _check_unpacked(values: torch.Tensor, name: str) -> None:
    if values.dim() != 2 or values.shape[1] % AWQ_PACK_FACTOR:
        raise ValueError(f"{name}: expected a 2-D tensor with a multiple of {AWQ_PACK_FACTOR} columns, "
                         f"got shape {tuple(values.shape)}")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) > 15):
        raise ValueError(f"{name}: 4-bit values must be in [0, 15]")


def pack_awq_int4(values: torch.Tensor, name: str = "values") -> torch.Tensor:
    """[rows, cols] integers in 0..15 -> int32 [rows, cols / 8] in AutoAWQ's interleaved nibble order."""
    _check_unpacked(values, name)
    rows, cols = values.shape
    v = values.to(torch.int64).reshape(rows, cols // AWQ_PACK_FACTOR, AWQ_PACK_FACTOR)
    packed = torch.zeros(rows, cols // AWQ_PACK_FACTOR, dtype=torch.int64, device=values.device)
    for nibble, column in enumerate(AWQ_PACK_ORDER):
        packed |= v[:, :, column] << (4 * nibble)
    # int64 holding a uint32 bit pattern -> the same bits as int32 (two's complement wrap)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_awq_int4(packed: torch.Tensor, name: str = "qweight") -> torch.Tensor:
    """int32 [rows, cols / 8] in AutoAWQ's order -> uint8 [rows, cols] with values 0..15."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D int32 tensor of packed 4-bit values, got "
                         f"{packed.dtype} with shape {tuple(packed.shape)}")
    bits = packed.to(torch.int64) & 0xFFFFFFFF
    rows, groups = packed.shape
    out = torch.empty(rows, groups, AWQ_PACK_FACTOR, dtype=torch.uint8, device=packed.device)
    for nibble, column in enumerate(AWQ_PACK_ORDER):
        out[:, :, column] = ((bits >> (4 * nibble)) & 0xF).to(torch.uint8)
    return out.reshape(rows, groups * AWQ_PACK_FACTOR)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 weight W [out, in] of one AutoAWQ layer (the definition above)."""
    q = unpack_awq_int4(qweight, "qweight").to(torch.float32)  # [in, out]
    z = unpack_awq_int4(qzeros, "qzeros").to(torch.float32)  # [in / group, out]
    s = scales.to(torch.float32)
    if q.shape[0] != z.shape[0] * group_size or z.shape != s.shape or q.shape[1] != s.shape[1]:
        raise ValueError(f"AWQ tensors disagree with group_size={group_size}: qweight unpacks to "
                         f"{tuple(q.shape)}, qzeros to {tuple(z.shape)}, scales {tuple(s.shape)}")
    w = (q - z.repeat_interleave(group_size, dim=0)) * s.repeat_interleave(group_size, dim=0)
    return w.t().contiguous()


def quantize_awq(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest 4-bit quantization of W [out, in] per (output row, group of `in`) ->
    (qweight, qzeros, scales) in AutoAWQ's layout. AWQ proper first scales input channels (see
    `pagellm quantize --method awq`); this is the rounding step it ends with."""
    out_features, in_features = weight.shape
    if in_features % group_size or out_features % AWQ_PACK_FACTOR:
        raise ValueError(f"AWQ needs in_features % group_size == 0 and out_features % 8 == 0; got weight "
                         f"{tuple(weight.shape)}, group_size={group_size}")
    w = weight.to(torch.float32).reshape(out_features, in_features // group_size, group_size)
    w_max, w_min = w.amax(dim=2), w.amin(dim=2)
    scales = ((w_max - w_min).clamp(min=1e-5) / 15).to(torch.float16)
    s = scales.to(torch.float32)
    zeros = torch.clamp(torch.round(-w_min / s), 0, 15)
    q = torch.clamp(torch.round(w / s.unsqueeze(2)) + zeros.unsqueeze(2), 0, 15)
    return pack_awq(q.reshape(out_features, in_features).to(torch.uint8), zeros.to(torch.uint8), scales)


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rounded groups in the logical orientation, q uint8 [out, in], zeros uint8 [out, in / group], scales
    float16 [out, in / group] (as `quantize_awq` or `awq_gptq.gptq_quantize` make them) -> AutoAWQ's
    (qweight, qzeros, scales)."""
    if scales.dtype != torch.float16 or zeros.shape != scales.shape or q.shape[0] != scales.shape[0]:
        raise ValueError(f"expected q [out, in], zeros and float16 scales [out, in / group]; got {tuple(q.shape)}, "
                         f"{tuple(zeros.shape)}, {tuple(scales.shape)} {scales.dtype}")
    qweight = pack_awq_int4(q.t(), "qweight")  # [in, out / 8]
    qzeros = pack_awq_int4(zeros.t(), "qzeros")  # [in / group, out / 8]
    return qweight, qzeros, scales.t().contiguous()


# The kernel layout of `torch.ops.pagellm.awq_linear` (what the loader repacks into): one row of bytes per
# output feature, in blocks of 32 along `in`; byte j (0..15) of block b holds q[n, 32b + j] in its low nibble
# and q[n, 32b + 16 + j] in its high nibble (ggml's Q4 nibble order, so one 16-byte load unpacks to two
# runs of 16 consecutive weights).
KERNEL_BLOCK = 32


def pack_kernel_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] with values 0..15 (in % 32 == 0) -> uint8 [out, in / 2] in awq_linear's layout."""
    if q.dim() != 2 or q.shape[1] % KERNEL_BLOCK:
        raise ValueError(f"expected [out, in] with in % {KERNEL_BLOCK} == 0, got shape {tuple(q.shape)}")
    blocks = q.to(torch.uint8).reshape(q.shape[0], -1, 2, KERNEL_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(q.shape[0], -1)


def unpack_kernel_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_kernel_int4`: uint8 [out, in / 2] -> uint8 [out, in] with values 0..15."""
    blocks = packed.reshape(packed.shape[0], -1, 1, KERNEL_BLOCK // 2)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=2).reshape(packed.shape[0], -1)


def awq_to_kernel_layout(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                         group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An AutoAWQ layer -> awq_linear's (qweight uint8 [out, in / 2], scales float32 [out, in / group],
    zeros uint8 [out, in / group]); exact (the same integers and scales)."""
    q = unpack_awq_int4(qweight, "qweight").t()  # [out, in]
    z = unpack_awq_int4(qzeros, "qzeros").t().contiguous()  # [out, in / group]
    s = scales.to(torch.float32).t().contiguous()
    if q.shape[1] != z.shape[1] * group_size or z.shape != s.shape:
        raise ValueError(f"AWQ tensors disagree with group_size={group_size}: qweight unpacks to "
                         f"{tuple(q.shape)} [out, in], qzeros to {tuple(z.shape)}, scales {tuple(s.shape)}")
    return pack_kernel_int4(q.contiguous()), s, z
