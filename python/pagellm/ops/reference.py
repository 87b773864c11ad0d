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
    "copy_slots",
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
    "linear_gemv",
    "linear_argmax",
    "linear_amx",
    "bf16_dot_peak",
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


def copy_slots(caches: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
    """For every cache tensor [num_blocks, num_kv_heads, block_size, ...]: the rows at slot dst = the rows at slot
    src for each (src, dst) row of slot_mapping [num_pairs, 2] (slot = block * block_size + offset), all sources read
    before any destination is written, pair after pair (a destination named twice gets the later pair's rows)."""
    src = slot_mapping[:, 0]
    for cache in caches:
        block_size = cache.shape[2]
        rows = cache[src // block_size, :, src % block_size].clone()
        for row, d in zip(rows, slot_mapping[:, 1].tolist()):
            cache[d // block_size, :, d % block_size] = row


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


def argmax_rows(out: torch.Tensor, logits: torch.Tensor) -> None:
    out.copy_(logits.argmax(dim=-1))


def gather_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
    out.copy_(src.index_select(0, index.to(torch.int64)))


def linear_small_m(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    out.copy_(F.linear(x.float(), weight.float(), None if bias is None else bias.float()))


def linear_gemv(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                kernel: int = 2, pdl: bool = False) -> None:
    """linear_small_m's product; the CUDA kernel choice and PDL change the summation order only."""
    linear_small_m(out, x, weight, bias)


def linear_argmax(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """argmax_rows of linear_small_m's output: the logits rounded to x's dtype, then torch's argmax rule."""
    logits = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    linear_small_m(logits, x, weight, bias)
    argmax_rows(out, logits)


def linear_amx(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """The same product as linear_small_m (fp32 accumulation, one rounding); bf16 only."""
    linear_small_m(out, x, weight, bias)


def bf16_dot_peak(out: torch.Tensor, num_iters: int) -> None:
    """What the peak loop leaves in every lane: 12 chains x num_iters pair dots of (1, 1) with (2^-7, 2^-7)."""
    out.fill_(12 * num_iters * 2.0**-6)


from pagellm.ops.quant_reference import (  # noqa: E402,F401  (re-export)
    GGUF_BLOCK_BYTES, GGUF_BLOCK_ELEMS, GGUF_QTYPES, awq_dequantize, awq_linear, gguf_dequantize, gguf_linear,
    gguf_row_bytes, int8_linear,
)
from pagellm.ops.tree_reference import paged_tree_attention, tree_attention_mask  # noqa: E402,F401  (re-export)
from pagellm.ops.lora_reference import lora_apply  # noqa: E402,F401  (re-export)
from pagellm.ops.moe_reference import fused_moe  # noqa: E402,F401  (re-export)
