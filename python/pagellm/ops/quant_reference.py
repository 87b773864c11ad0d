"""Pure-torch references of the quantized matmuls: gguf_linear (GGUF blocks, dequantized exactly as gguf-py),
awq_linear (AWQ 4-bit groups in the kernel layout) and int8_linear (LLM.int8()). Re-exported by `reference.py`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------- GGUF blocks (csrc/ops/quant/gguf_blocks.h)

# ggml type id by name, elements per block and bytes per block of the block types gguf_linear multiplies natively
# (the k-quants Q4_K / Q6_K are super-blocks of 256).
GGUF_QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
GGUF_BLOCK_ELEMS = {2: 32, 3: 32, 8: 32, 12: 256, 14: 256}
GGUF_BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 12: 144, 14: 210}


def gguf_row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one weight row of `in_features` elements (a multiple of GGUF_BLOCK_ELEMS[qtype]) in `qtype`."""
    return in_features // GGUF_BLOCK_ELEMS[qtype] * GGUF_BLOCK_BYTES[qtype]


def _fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of every block [..., bytes] -> float32 [..., 1]."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [..., 16] uint8 -> [..., 32] float: the low nibbles are elements 0..15, the high ones 16..31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1).float()


def _q4_k_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K super-blocks [..., 144] -> [..., 256]: fp16 d, dmin; 12 bytes of 8 6-bit scales sc and mins mn (bytes
    0-3: sc[0:4] in bits 0-5, sc[4:8] bits 4-5 in bits 6-7; bytes 4-7: the same for mn; bytes 8-11: sc[4:8]
    bits 0-3 low, mn[4:8] bits 0-3 high); 128 bytes of nibbles, 32 bytes per pair of 32-element sub-blocks (low
    nibbles first). w = (d sc) q - dmin mn per sub-block."""
    d, dmin = _fp16_field(blocks, 0), _fp16_field(blocks, 2)
    sc_lo, mn_lo, hi = blocks[..., 4:8].int(), blocks[..., 8:12].int(), blocks[..., 12:16].int()
    sc = torch.cat([sc_lo & 0x3F, (hi & 0xF) | ((sc_lo >> 6) << 4)], dim=-1).float()
    mn = torch.cat([mn_lo & 0x3F, (hi >> 4) | ((mn_lo >> 6) << 4)], dim=-1).float()
    qs = blocks[..., 16:].reshape(blocks.shape[:-1] + (4, 1, 32))
    q = torch.cat([qs & 0xF, qs >> 4], dim=-2).reshape(blocks.shape[:-1] + (8, 32)).float()
    return ((d * sc)[..., None] * q - (dmin * mn)[..., None]).flatten(-2)


def _q6_k_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks [..., 210] -> [..., 256]: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8
    scales (one per 16 elements), fp16 d; q = ql | qh << 4 in 0..63, w = (d scale) (q - 32). Per half of 128
    elements: ql bytes [0:32] low nibbles are elements 0-31, [32:64] low 32-63, [0:32] high 64-95, [32:64] high
    96-127; qh byte l holds bits 4-5 of elements l, l + 32, l + 64, l + 96 in its bit pairs 0-1 .. 6-7."""
    lead = blocks.shape[:-1]
    ql = blocks[..., :128].reshape(lead + (2, 1, 64))
    ql = torch.cat([ql & 0xF, ql >> 4], dim=-2).reshape(lead + (8, 32))
    qh = blocks[..., 128:192].reshape(lead + (2, 1, 32))
    qh = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-2).reshape(lead + (8, 32))
    q = (ql | (qh << 4)).float() - 32
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    return ((_fp16_field(blocks, 208) * scales)[..., None] * q.reshape(lead + (16, 16))).flatten(-2)


def gguf_dequantize(qweight: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """qweight uint8 [N, gguf_row_bytes(qtype, in_features)] -> float32 [N, in_features], as gguf.quants does:
    Q8_0 d * q, Q4_0 d * (q - 8), Q4_1 d * q + m (d, m fp16 per block of 32); Q4_K, Q6_K per super-block of 256
    (`_q4_k_dequantize`, `_q6_k_dequantize`)."""
    blocks = qweight.reshape(qweight.shape[0], in_features // GGUF_BLOCK_ELEMS[qtype], GGUF_BLOCK_BYTES[qtype])
    if qtype == GGUF_QTYPES["Q4_K"]:
        return _q4_k_dequantize(blocks).reshape(qweight.shape[0], in_features)
    if qtype == GGUF_QTYPES["Q6_K"]:
        return _q6_k_dequantize(blocks).reshape(qweight.shape[0], in_features)
    d = _fp16_field(blocks, 0)
    if qtype == GGUF_QTYPES["Q8_0"]:
        w = d * blocks[..., 2:].contiguous().view(torch.int8).float()
    elif qtype == GGUF_QTYPES["Q4_0"]:
        w = d * (_nibbles(blocks[..., 2:]) - 8)
    else:
        w = d * _nibbles(blocks[..., 4:]) + _fp16_field(blocks, 2)
    return w.reshape(qweight.shape[0], in_features)


def gguf_linear(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, qtype: int, in_features: int,
                bias: torch.Tensor | None = None) -> None:
    """out [M, N] = x [M, K] @ gguf_dequantize(qweight)^T (+ bias [N]) in float32, rounded once into out."""
    w = gguf_dequantize(qweight, qtype, in_features)
    out.copy_(F.linear(x.float(), w, None if bias is None else bias.float()))


# ---------------------------------------------------------------- AWQ 4-bit groups (csrc/ops/quant/awq_layout.h)


def awq_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """qweight uint8 [N, K / 2] (awq_linear's layout: blocks of 32 along K, byte j of a block holds element j in
    its low nibble and j + 16 in its high one), scales float32 / zeros uint8 [N, K / group_size] ->
    float32 W [N, K] = (q - zeros) * scales, per group of `group_size` consecutive k."""
    n = qweight.shape[0]
    q = _nibbles(qweight.reshape(n, -1, 16)).reshape(n, -1)  # same nibble order as GGUF's Q4 blocks
    z = zeros.float().repeat_interleave(group_size, dim=1)
    s = scales.float().repeat_interleave(group_size, dim=1)
    return (q - z) * s


def awq_linear(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, bias: torch.Tensor | None = None) -> None:
    """out [M, N] = x [M, K] @ awq_dequantize(...)^T (+ bias [N]) in float32, rounded once into out."""
    w = awq_dequantize(qweight, scales, zeros, group_size)
    out.copy_(F.linear(x.float(), w, None if bias is None else bias.float()))


# ---------------------------------------------------------------- int8 (LLM.int8())


def int8_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, threshold: float = 6.0, zero_point: bool = False,
                group_size: int = 0) -> None:
    """LLM.int8() (Dettmers et al. 2022): out [M, N] = x [M, K] @ (weight [N, K] int8 * weight_scale [N])^T (+ bias).

    Columns of x with |x| > threshold in any row (threshold 0: none) are multiplied in fp32 by the dequantized
    weight. The other columns (outlier columns zeroed) are quantized per row:
      absmax (zero_point False, bitsandbytes): s_m = absmax_m / 127,
        q = clamp(round_half_even(x * (127 / absmax_m)), -127, 127), z_m = 0;
      zero point (the paper's zero-point vector-wise): over the row's range widened to hold 0, lo_m = min(min x, 0),
        hi_m = max(max x, 0): s_m = (hi_m - lo_m) / 255, z_m = round_half_even(-lo_m * (255 / (hi_m - lo_m))),
        q = clamp(round_half_even(x * (255 / (hi_m - lo_m))) + z_m, 0, 255) (a zeroed column is exactly z_m);
      per token group (group_size > 0, absmax, vLLM's per-token-group rule): one scale per group g of
        group_size consecutive elements of K (the last group may be shorter), s_mg = absmax_mg / 127;
    and multiplied as sum (q - z_m) * weight -> int32 (exact; here in float64, exact below 2^53), rescaled by
    s_m * weight_scale[n]; per group, the int32 sum of each group times s_mg, summed in fp32, times
    weight_scale[n]. Every scale is one IEEE-rounded fp32 operation, as in the kernels. Rounded once into
    out. Shape branches only (no data read into Python): replayable in a step graph."""
    if out.numel() == 0:
        return
    xf = x.float()
    if threshold > 0:
        outlier = xf.abs().amax(dim=0) > threshold  # [K]
    else:
        outlier = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
    x_in = torch.where(outlier, 0.0, xf)
    empty = torch.zeros(x.shape[0], device=x.device)
    # a tensor / tensor division is IEEE-rounded, as in the kernels (127.0 / t is reciprocal(t) * 127 in torch)
    if group_size > 0:
        y = _int8_groups(x_in, weight, group_size) * weight_scale[None, :]
    elif zero_point:
        lo = x_in.amin(dim=1).clamp(max=0.0) if x.shape[1] else empty  # [M]
        hi = x_in.amax(dim=1).clamp(min=0.0) if x.shape[1] else empty
        span = hi - lo
        inv = torch.where(span > 0, torch.full_like(span, 255.0) / span, 0.0)
        z = torch.round(-lo * inv).clamp(0, 255)
        q = (torch.round(x_in * inv[:, None]) + z[:, None]).clamp(0, 255) - z[:, None]
        row_scale = span / torch.full_like(span, 255.0)  # a true division on every device
    else:
        absmax = x_in.abs().amax(dim=1) if x.shape[1] else empty  # [M]
        inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, 0.0)
        q = torch.round(x_in * inv[:, None]).clamp(-127, 127)
        row_scale = absmax / torch.full_like(absmax, 127.0)  # tensor / tensor: IEEE-rounded on CUDA too
    if group_size <= 0:
        acc = (q.double() @ weight.double().T).float()
        y = acc * (row_scale[:, None] * weight_scale[None, :])
    y = y + torch.where(outlier, xf, 0.0) @ (weight.float() * weight_scale[:, None]).T
    if bias is not None:
        y = y + bias.float()
    out.copy_(y)


def _int8_groups(x_in: torch.Tensor, weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """sum_g s_mg * (sum_{k in g} q[m, k] w[n, k]) in fp32 [M, N], x_in [M, K] fp32 quantized by absmax per
    (row, group of group_size elements of K); the groups' int32 sums exact (float64)."""
    y = torch.zeros(x_in.shape[0], weight.shape[0], device=x_in.device)
    for k0 in range(0, x_in.shape[1], group_size):
        xg = x_in[:, k0:k0 + group_size]
        absmax = xg.abs().amax(dim=1)
        inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, 0.0)
        q = torch.round(xg * inv[:, None]).clamp(-127, 127)
        acc = (q.double() @ weight[:, k0:k0 + group_size].double().T).float()
        y = y + acc * (absmax / torch.full_like(absmax, 127.0))[:, None]
    return y
