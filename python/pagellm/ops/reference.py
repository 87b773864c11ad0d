"""Readable pure-torch references of every torch.ops.pagellm op (same signatures, same in-place outputs).

They define the semantics the C++/CUDA kernels are tested against and power the `torch` attention
backend. Math is fp32; results are rounded once into the output dtype (RMSNorm follows HF Llama's
rounding order: normalize in fp32, cast to the input dtype, then multiply by the weight).
KV-cache layout: docs/kv_cache_layout.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.ops.paged_context import gather_context

__all__ = [
    "reshape_and_cache",
    "reshape_and_cache_quantized",
    "quantize_kv_rows",
    "copy_blocks",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_attention_decode_quantized",
    "paged_attention_prefill_quantized",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_and_mul",
    "linear_small_m",
    "linear_amx",
    "int8_linear",
    "GGUF_QTYPES",
    "GGUF_BLOCK_BYTES",
    "GGUF_BLOCK_ELEMS",
    "gguf_row_bytes",
    "gguf_dequantize",
    "gguf_linear",
    "awq_dequantize",
    "awq_linear",
    "fused_moe",
]


# ---------------------------------------------------------------- cache ops


def reshape_and_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """cache[slot // block_size, :, slot % block_size, :] = key/value[t]; slot -1 is skipped."""
    block_size = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, :, offsets, :] = key[keep]
    value_cache[blocks, :, offsets, :] = value[keep]


def quantize_kv_rows(x: torch.Tensor, storage_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmax quantization of every row of x [..., head_dim] -> (stored [..., head_dim], scale [...] float32).

    scale = absmax / qmax and stored = Q(x * (qmax / absmax)), qmax = 127 (int8: round half to even, clamped
    to +-127) or 448 (float8_e4m3fn: clamped to +-448, rounded to nearest even); a zero row stores zeros with
    scale 0. stored * scale is the value meant. Divisions are tensor / tensor (correctly rounded on every
    device), so the kernels reproduce these bits exactly.
    """
    qmax = 127.0 if storage_dtype == torch.int8 else 448.0
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    qmax_t = torch.full_like(amax, qmax)
    inv = torch.where(amax > 0, qmax_t / amax, torch.zeros_like(amax))
    scaled = (xf * inv[..., None]).clamp(-qmax, qmax)
    stored = scaled.round().to(torch.int8) if storage_dtype == torch.int8 else scaled.to(storage_dtype)
    return stored, amax / qmax_t


def reshape_and_cache_quantized(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """reshape_and_cache into a quantized cache: each (token, kv head) row quantized by quantize_kv_rows,
    its scale at scale[slot // block_size, head, slot % block_size]; slot -1 is skipped."""
    block_size = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    for cache, scales, x in ((key_cache, k_scale, key), (value_cache, v_scale, value)):
        stored, scale = quantize_kv_rows(x[keep], cache.dtype)
        cache.view(torch.uint8)[blocks, :, offsets, :] = stored.view(torch.uint8)  # byte view: fp8 has no index_put
        scales[blocks, :, offsets] = scale


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """For every layer, copy block src -> dst for each (src, dst) row of block_mapping."""
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in [*key_caches, *value_caches]:
        cache[dst] = cache[src].clone()


# ---------------------------------------------------------------- attention


def _gather_dequantized(cache: torch.Tensor, scales: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] float32 = stored * scale of one sequence of a quantized cache."""
    stored = gather_context(cache.view(torch.uint8), block_table, seq_len).view(cache.dtype)
    return stored.float() * gather_context(scales.unsqueeze(-1), block_table, seq_len)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float, window_size: int, softcap: float
) -> torch.Tensor:
    """Causal (optionally windowed, soft-capped) attention in fp32. q [n, Hq, D]; k, v [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [Hq, n, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, n, L]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    k_pos = torch.arange(k.shape[0], device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window_size > 0:
        visible &= k_pos[None, :] > q_pos[:, None] - window_size
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty context -> zeros
    return torch.matmul(probs, vf).transpose(0, 1)  # [n, Hq, D]


def paged_attention_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window_size: int = -1,
    softcap: float = 0.0,
) -> None:
    """One query token per sequence, at position seq_len - 1."""
    def context(i: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_context(key_cache, block_tables[i], seq_len), gather_context(value_cache, block_tables[i], seq_len)

    _decode(out, query, context, seq_lens, scale, window_size, softcap)


def _decode(out, query, context, seq_lens, scale: float, window_size: int, softcap: float) -> None:
    for i, seq_len in enumerate(seq_lens.tolist()):
        k, v = context(i, seq_len)
        pos = torch.tensor([seq_len - 1], device=query.device)
        out[i : i + 1] = _attend(query[i : i + 1], k, v, pos, scale, window_size, softcap).to(out.dtype)


def paged_attention_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window_size: int = -1,
    softcap: float = 0.0,
) -> None:
    """Chunk i's q_len = qsl[i+1] - qsl[i] queries are the LAST q_len positions of its seq_lens[i] context."""
    def context(i: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_context(key_cache, block_tables[i], seq_len), gather_context(value_cache, block_tables[i], seq_len)

    _prefill(out, query, context, query_start_loc, seq_lens, scale, window_size, softcap)


def _prefill(out, query, context, query_start_loc, seq_lens, scale: float, window_size: int, softcap: float) -> None:
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        k, v = context(i, seq_len)
        pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        out[start:end] = _attend(query[start:end], k, v, pos, scale, window_size, softcap).to(out.dtype)


def _dequantized_context(key_cache, value_cache, k_scale, v_scale, block_tables):
    def context(i: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (_gather_dequantized(key_cache, k_scale, block_tables[i], seq_len),
                _gather_dequantized(value_cache, v_scale, block_tables[i], seq_len))

    return context


def paged_attention_decode_quantized(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window_size: int = -1,
    softcap: float = 0.0,
) -> None:
    """paged_attention_decode over a quantized cache: keys/values are stored * scale of their row (fp32)."""
    context = _dequantized_context(key_cache, value_cache, k_scale, v_scale, block_tables)
    _decode(out, query, context, seq_lens, scale, window_size, softcap)


def paged_attention_prefill_quantized(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window_size: int = -1,
    softcap: float = 0.0,
) -> None:
    """paged_attention_prefill over a quantized cache: keys/values are stored * scale of their row (fp32)."""
    context = _dequantized_context(key_cache, value_cache, k_scale, v_scale, block_tables)
    _prefill(out, query, context, query_start_loc, seq_lens, scale, window_size, softcap)


# ---------------------------------------------------------------- norms and rotary


def _rms_normalize(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """HF Llama order: fp32 normalize, cast to x.dtype, multiply by weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return weight * xf.to(x.dtype)


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    out.copy_(_rms_normalize(input, weight, epsilon))


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """residual += input (rounded to its dtype); input = rms_norm(residual) * weight."""
    residual.add_(input)
    input.copy_(_rms_normalize(residual, weight, epsilon))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """x [T, H, rot] in fp32; cos/sin [T, 1, rot/2]."""
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotates the first rotary_dim = cos_sin_cache.shape[1] dims of every head of query and key in place."""
    rot = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.reshape(-1)].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_size)
        heads[..., :rot] = _rotate(heads[..., :rot].float(), cos, sin, is_neox).to(x.dtype)


# ---------------------------------------------------------------- activations


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    d = input.shape[-1] // 2
    x = input.float()
    out.copy_(F.silu(x[..., :d]) * x[..., d:])


def gelu_and_mul(out: torch.Tensor, input: torch.Tensor, approximate: str = "none") -> None:
    d = input.shape[-1] // 2
    x = input.float()
    out.copy_(F.gelu(x[..., :d], approximate=approximate) * x[..., d:])


# ---------------------------------------------------------------- linear


def linear_small_m(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    out.copy_(F.linear(x.float(), weight.float(), None if bias is None else bias.float()))


def linear_amx(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """The same product as linear_small_m (fp32 accumulation, one rounding); bf16 only."""
    linear_small_m(out, x, weight, bias)


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
                bias: torch.Tensor | None = None, threshold: float = 6.0) -> None:
    """LLM.int8() (Dettmers et al. 2022): out [M, N] = x [M, K] @ (weight [N, K] int8 * weight_scale [N])^T (+ bias).

    Columns of x with |x| > threshold in any row (threshold 0: none) are multiplied in fp32 by the dequantized
    weight. The other columns are quantized per row by their absmax, s_m = absmax_m / 127 and
    q = clamp(round_half_even(x * (127 / absmax_m)), -127, 127), and multiplied as int8 x int8 -> int32
    (exact; here in float64, exact below 2^53), rescaled by s_m * weight_scale[n]. Rounded once into out.
    Shape branches only (no data read into Python): replayable in a step graph."""
    if out.numel() == 0:
        return
    xf = x.float()
    if threshold > 0:
        outlier = xf.abs().amax(dim=0) > threshold  # [K]
    else:
        outlier = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
    x_in = torch.where(outlier, 0.0, xf)
    absmax = x_in.abs().amax(dim=1) if x.shape[1] else torch.zeros(x.shape[0], device=x.device)  # [M]
    # a tensor / tensor division is IEEE-rounded, as in the kernels (127.0 / t is reciprocal(t) * 127 in torch)
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, 0.0)
    q = torch.round(x_in * inv[:, None]).clamp(-127, 127)
    acc = (q.double() @ weight.double().T).float()
    y = acc * ((absmax / 127.0)[:, None] * weight_scale[None, :])
    y = y + torch.where(outlier, xf, 0.0) @ (weight.float() * weight_scale[:, None]).T
    if bias is not None:
        y = y + bias.float()
    out.copy_(y)
from pagellm.ops.tree_reference import paged_tree_attention, tree_attention_mask  # noqa: E402,F401  (re-export)
from pagellm.ops.lora_reference import lora_apply  # noqa: E402,F401  (re-export)
from pagellm.ops.moe_reference import fused_moe  # noqa: E402,F401  (re-export)
