"""torch.ops.pagellm kernels (C++/CUDA), with thin Python wrappers of the same names.

Importing this module loads pagellm._C (which registers the ops) and their fake implementations.
Each wrapper validates cheaply what it can (raising TypeError/ValueError naming the argument) and
calls torch.ops.pagellm.<name>; the C++ side checks everything again (RuntimeError). All ops write
into given tensors and return None. Pure-torch equivalents: pagellm.ops.reference.
KV-cache layout: docs/kv_cache_layout.md.
"""

from __future__ import annotations

import torch

_LOAD_ERROR: Exception | None = None
try:
    import pagellm._C  # noqa: F401  (registers torch.ops.pagellm.*)
except ImportError as e:  # pragma: no cover - depends on the build
    _LOAD_ERROR = e
else:
    from pagellm.ops.fake import register_fakes

    register_fakes()

__all__ = [
    "ops_available",
    "reshape_and_cache",
    "reshape_and_cache_quantized",
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
    "linear_amx",
    "linear_argmax",
    "bf16_dot_peak",
    "argmax_rows",
    "gather_rows",
    "amx_available",
    "int8_linear",
    "gguf_linear",
    "awq_linear",
    "lora_apply",
    "fused_moe",
]

from pagellm.ops.arg_checks import _check_attention, _check_quantized_cache, _dtype, _float, _ndim, _same, _tensor  # noqa: E402


def ops_available() -> tuple[bool, str]:
    """Whether the compiled ops are loaded; the import error when not."""
    return (_LOAD_ERROR is None, "" if _LOAD_ERROR is None else f"pagellm._C failed to import: {_LOAD_ERROR}")


def reshape_and_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes key/value [num_tokens, num_kv_heads, head_dim] into the paged caches at slot_mapping (-1 = skip)."""
    _float(key_cache, "key_cache")
    for t, n in ((value_cache, "value_cache"), (key, "key"), (value, "value")):
        _tensor(t, n)
        _same(t, key_cache, n, "key_cache")
    _dtype(slot_mapping, torch.int64, "slot_mapping")
    torch.ops.pagellm.reshape_and_cache(key_cache, value_cache, key, value, slot_mapping)


def reshape_and_cache_quantized(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Quantizes key/value [num_tokens, num_kv_heads, head_dim] row by row (absmax per token and kv head) into
    int8 / float8_e4m3fn caches and their scales [num_blocks, num_kv_heads, block_size] at slot_mapping (-1 =
    skip). Exact rule: reference.quantize_kv_rows."""
    _check_quantized_cache(key_cache, value_cache, k_scale, v_scale)
    _float(key, "key")
    _tensor(value, "value")
    _same(value, key, "value", "key")
    _dtype(slot_mapping, torch.int64, "slot_mapping")
    torch.ops.pagellm.reshape_and_cache_quantized(key_cache, value_cache, k_scale, v_scale, key, value, slot_mapping)


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """For every layer, copies cache block src -> dst for each row (src, dst) of block_mapping [num_pairs, 2]."""
    if len(key_caches) != len(value_caches):
        raise ValueError(f"key_caches and value_caches must have the same length, got {len(key_caches)} and {len(value_caches)}")
    _dtype(block_mapping, torch.int64, "block_mapping")
    torch.ops.pagellm.copy_blocks(list(key_caches), list(value_caches), block_mapping)


def copy_slots(caches: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
    """In every cache tensor [num_blocks, num_kv_heads, block_size, ...] (values or scales, any dtype), copies the rows
    of slot src to slot dst for each row (src, dst) of slot_mapping [num_pairs, 2], every source read before any
    destination is written (a destination named twice gets the later pair's rows). One call for a tree path's KV move
    across all layers."""
    if not isinstance(caches, (list, tuple)) or not all(isinstance(c, torch.Tensor) for c in caches):
        raise TypeError("caches must be a list of tensors")
    _dtype(slot_mapping, torch.int64, "slot_mapping")
    torch.ops.pagellm.copy_slots(list(caches), slot_mapping)


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
    """out[i] = attention of query[i] (position seq_lens[i]-1) over sequence i's paged context."""
    _check_attention(out, query, key_cache, value_cache, block_tables, seq_lens)
    torch.ops.pagellm.paged_attention_decode(
        out, query, key_cache, value_cache, block_tables, seq_lens, float(scale), int(window_size), float(softcap)
    )


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
    """Causal attention of each chunk's queries (the last q_len positions of its sequence) over its context."""
    _check_attention(out, query, key_cache, value_cache, block_tables, seq_lens)
    _dtype(query_start_loc, torch.int32, "query_start_loc")
    torch.ops.pagellm.paged_attention_prefill(
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        float(scale), int(window_size), float(softcap),
    )  # fmt: skip


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
    """paged_attention_decode over an int8 / float8_e4m3fn cache (a row's value = stored * its scale)."""
    _check_attention(out, query, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale)
    torch.ops.pagellm.paged_attention_decode_quantized(
        out, query, key_cache, value_cache, k_scale, v_scale, block_tables, seq_lens, float(scale), int(window_size),
        float(softcap),
    )  # fmt: skip


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
    """paged_attention_prefill over an int8 / float8_e4m3fn cache (a row's value = stored * its scale)."""
    _check_attention(out, query, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale)
    _dtype(query_start_loc, torch.int32, "query_start_loc")
    torch.ops.pagellm.paged_attention_prefill_quantized(
        out, query, key_cache, value_cache, k_scale, v_scale, block_tables, query_start_loc, seq_lens, float(scale),
        int(window_size), float(softcap),
    )  # fmt: skip


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """out = T(input * rsqrt(mean(input^2) + eps)) * weight, fp32 math (HF Llama rounding)."""
    _float(input, "input")
    _tensor(out, "out")
    _same(out, input, "out", "input")
    _tensor(weight, "weight")
    _same(weight, input, "weight", "input")
    torch.ops.pagellm.rms_norm(out, input, weight, float(epsilon))


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """residual += input; input = rms_norm(residual) * weight (both in place)."""
    _float(input, "input")
    _tensor(residual, "residual")
    _same(residual, input, "residual", "input")
    _tensor(weight, "weight")
    _same(weight, input, "weight", "input")
    torch.ops.pagellm.fused_add_rms_norm(input, residual, weight, float(epsilon))


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotates query/key [T, heads*head_size] (or [T, heads, head_size]) in place; cache [max_pos, rot] = cos|sin."""
    _dtype(positions, torch.int64, "positions")
    _float(query, "query")
    _tensor(key, "key")
    _same(key, query, "key", "query")
    _float(cos_sin_cache, "cos_sin_cache")
    if int(head_size) <= 0:
        raise ValueError(f"head_size must be positive, got {head_size}")
    torch.ops.pagellm.rotary_embedding(positions, query, key, int(head_size), cos_sin_cache, bool(is_neox))


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """out [..., d] = silu(input[..., :d]) * input[..., d:]."""
    _float(input, "input")
    _tensor(out, "out")
    _same(out, input, "out", "input")
    torch.ops.pagellm.silu_and_mul(out, input)


def gelu_and_mul(out: torch.Tensor, input: torch.Tensor, approximate: str = "none") -> None:
    """out [..., d] = gelu(input[..., :d], approximate) * input[..., d:]; approximate is "none" or "tanh"."""
    _float(input, "input")
    _tensor(out, "out")
    _same(out, input, "out", "input")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    torch.ops.pagellm.gelu_and_mul(out, input, approximate)


def argmax_rows(out: torch.Tensor, logits: torch.Tensor) -> None:
    """out int64 [N] = logits [N, V].argmax(-1) (first maximum; NaN counts as the maximum); CPU tensors."""
    _float(logits, "logits")
    _ndim(logits, 2, "logits")
    _dtype(out, torch.int64, "out")
    if tuple(out.shape) != (logits.shape[0],):
        raise ValueError(f"out shape {tuple(out.shape)} must be {(logits.shape[0],)}")
    if logits.shape[1] == 0 and logits.shape[0] > 0:
        raise ValueError("logits must have at least one column")
    if logits.device.type != "cpu" or out.device.type != "cpu":
        raise ValueError(f"argmax_rows runs on CPU tensors, got {logits.device} / {out.device}")
    torch.ops.pagellm.argmax_rows(out, logits)


def gather_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
    """out [N, D] = src [R, D][index [N]] (int64 / int32 indices in [0, R)); CPU tensors of one dtype."""
    _tensor(out, "out")
    _tensor(src, "src")
    _same(out, src, "out", "src")
    _ndim(src, 2, "src")
    _ndim(_tensor(index, "index"), 1, "index")
    if index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"index must have dtype int64 or int32, got {index.dtype}")
    if tuple(out.shape) != (index.shape[0], src.shape[1]):
        raise ValueError(f"out shape {tuple(out.shape)} must be {(index.shape[0], src.shape[1])}")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= src.shape[0]):
        raise ValueError(f"index values must lie in [0, {src.shape[0]}), got [{int(index.min())}, {int(index.max())}]")
    torch.ops.pagellm.gather_rows(out, src, index)


def linear_small_m(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), fp32 accumulation; weight-streaming kernel for small M."""
    _float(x, "x")
    _check_linear(out, x, weight, bias)
    torch.ops.pagellm.linear_small_m(out, x, weight, bias)


def linear_argmax(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """out int64 [M] = argmax over N of linear_small_m's out [M, N] (the first maximum; NaN counts as the maximum):
    the greedy LM head, which at M <= 16 (a decode row, a verify step's 1 + k rows) never stores the logits. CPU
    tensors."""
    _float(x, "x")
    _dtype(_tensor(out, "out"), torch.int64, "out")
    _ndim(x, 2, "x")
    if tuple(out.shape) != (x.shape[0],):
        raise ValueError(f"out shape {tuple(out.shape)} must be {(x.shape[0],)}")
    _check_linear(torch.empty((x.shape[0], weight.shape[0] if weight.dim() else 0), dtype=x.dtype, device=x.device),
                  x, weight, bias)
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} must be {(weight.shape[0],)}")
    if x.device.type != "cpu":
        raise ValueError(f"linear_argmax runs on CPU tensors, got {x.device}")
    torch.ops.pagellm.linear_argmax(out, x, weight, bias)


def _check_linear(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    for t, n in ((out, "out"), (weight, "weight")):
        _tensor(t, n)
        _same(t, x, n, "x")
    if bias is not None:
        _tensor(bias, "bias")
        _same(bias, x, "bias", "x")
    _ndim(x, 2, "x")
    _ndim(weight, 2, "weight")
    _ndim(out, 2, "out")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} must be [N, {x.shape[1]}] (K of x)")
    if tuple(out.shape) != (x.shape[0], weight.shape[0]):
        raise ValueError(f"out shape {tuple(out.shape)} must be {(x.shape[0], weight.shape[0])}")


def amx_available() -> bool:
    """Whether linear_amx can run here: pagellm._C built with AMX-BF16, the CPU has it, the OS allows it."""
    return _LOAD_ERROR is None and bool(pagellm._C.cpu_has_amx_bf16())


def linear_amx(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]) in bfloat16 on Intel AMX tiles, fp32 accumulation.

    Raises RuntimeError where AMX is not available (see amx_available())."""
    _dtype(x, torch.bfloat16, "x")
    _check_linear(out, x, weight, bias)
    torch.ops.pagellm.linear_amx(out, x, weight, bias)


def bf16_dot_peak(out: torch.Tensor, num_iters: int) -> None:
    """A register-only loop of num_iters x 12 independent bf16 pair dot products (vdpbf16ps, 64 FLOP each) in the
    loaded CPU kernel library: time it for this core's bf16 ceiling. out float32 [16] = 12 * num_iters * 2^-6."""
    _tensor(out, "out")
    _dtype(out, torch.float32, "out")
    if tuple(out.shape) != (16,):
        raise ValueError(f"out shape {tuple(out.shape)} must be (16,)")
    if not isinstance(num_iters, int) or not 0 <= num_iters <= 1 << 20:
        raise ValueError(f"num_iters must be an int in [0, {1 << 20}], got {num_iters!r}")
    torch.ops.pagellm.bf16_dot_peak(out, num_iters)


from pagellm.ops.quant import awq_linear, gguf_linear, int8_linear  # noqa: E402,F401
from pagellm.ops.moe import fused_moe  # noqa: E402,F401  (issue 18: MoE)
from pagellm.ops.lora import lora_apply  # noqa: E402,F401  (issue 19: LoRA)
from pagellm.ops.tree import paged_tree_attention, tree_depths, tree_mask_from_parents  # noqa: E402,F401  (issue 17)
