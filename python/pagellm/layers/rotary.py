"""Rotary position embeddings: cos/sin caches for the HF rope types, applied via `ops.rotary_embedding`.

The cache is `[max_position, rotary_dim]` = cat(cos, sin) halves (each rotary_dim // 2), computed in
float32 exactly as transformers does (inv_freq, then `position.float() * inv_freq`, cos/sin, times
the attention scaling) and then cast to the model dtype -- HF also casts cos/sin to the activation
dtype before rotating, so rotation happens in the model dtype in both.

Supported `rope_type`s: default, linear, dynamic (NTK; see _dynamic_freqs), llama3, yarn (DeepSeek's
mscale / mscale_all_dim included; see _yarn_inv_freq).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagellm.layers._ops import ops


def _base_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float) / rotary_dim))


def _llama3_inv_freq(base: float, rotary_dim: int, params: dict) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, rotary_dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, rotary_dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_factor) of YaRN as transformers computes it: extrapolated frequencies above
    beta_fast rotations, interpolated (/ factor) below beta_slow, a linear ramp between; the cos/sin scale
    is attention_factor, else mscale / mscale_all_dim (DeepSeek), else get_mscale(factor)."""
    original = params.get("original_max_position_embeddings") or max_position
    factor = params.get("factor") or max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(dtype=torch.float) / rotary_dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def _dynamic_freqs(base: float, rotary_dim: int, max_position: int, factor: float, cache_len: int) -> torch.Tensor:
    """Angles [cache_len, rotary_dim // 2] for dynamic NTK. transformers recomputes one base from the batch's
    longest sequence at run time; a paged cache needs fixed per-position angles, so position p uses the base
    HF would use for a sequence of length max(p + 1, max_position): identical to HF up to max_position."""
    t = torch.arange(cache_len, dtype=torch.int64)
    seq_len = torch.clamp(t + 1, min=max_position).to(torch.float64)
    scaled = base * ((factor * seq_len / max_position) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float) / rotary_dim
    inv = 1.0 / (scaled.to(torch.float)[:, None] ** exps[None, :])
    inv[:max_position] = _base_inv_freq(base, rotary_dim)[None, :]
    return t.float()[:, None] * inv


def compute_inv_freq(rope_parameters: dict[str, Any], rotary_dim: int, max_position: int) -> tuple[torch.Tensor, float, int]:
    """(inv_freq float32 [rotary_dim // 2], attention_scaling, cache_len) for one rope config."""
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default")) or "default"
    base = float(rope_parameters.get("rope_theta", 10000.0))
    if rope_type == "default":
        return _base_inv_freq(base, rotary_dim), 1.0, max_position
    if rope_type == "linear":
        return _base_inv_freq(base, rotary_dim) / rope_parameters["factor"], 1.0, max_position
    if rope_type == "llama3":
        return _llama3_inv_freq(base, rotary_dim, rope_parameters), 1.0, max_position
    if rope_type == "dynamic":
        # Per-position inverse frequencies are built in RotaryEmbedding (see _dynamic_freqs).
        return _base_inv_freq(base, rotary_dim), 1.0, int(max_position * rope_parameters["factor"])
    if rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(base, rotary_dim, rope_parameters, max_position)
        return inv_freq, attention_factor, max_position
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, dynamic, llama3, yarn")


class RotaryEmbedding(nn.Module):
    """Applies rope in place to query [T, Hq*D or Hq, D] and key using a precomputed cos/sin cache."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, rope_parameters: dict[str, Any],
                 is_neox_style: bool = True, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        if rotary_dim > head_size or rotary_dim % 2:
            raise ValueError(f"bad rotary_dim {rotary_dim} for head_size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        self.rope_parameters = dict(rope_parameters)
        inv_freq, scaling, cache_len = compute_inv_freq(self.rope_parameters, rotary_dim, max_position)
        self.max_position = cache_len
        t = torch.arange(cache_len, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq[None, :]  # HF: position_ids.float() * inv_freq (fp32)
        if self.rope_parameters.get("rope_type") == "dynamic":
            freqs = _dynamic_freqs(float(self.rope_parameters.get("rope_theta", 10000.0)), rotary_dim, max_position,
                                   float(self.rope_parameters["factor"]), cache_len)
        cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", cache.to(device) if device is not None else cache, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops.rotary_embedding(positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox_style)
        return query, key

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
                f"neox={self.is_neox_style}, rope={self.rope_parameters}")


def rope_parameters_from_config(config) -> dict[str, Any]:
    """Normalized rope dict {rope_type, rope_theta, ...} from an HF config (transformers 5.x
    `rope_parameters`, or 4.x `rope_scaling` + `rope_theta`)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # per-layer-type dicts (e.g. {"full_attention": {...}}); take the full-attention one
        params = params.get("full_attention") or next(iter(params.values()))
    out: dict[str, Any] = dict(params) if isinstance(params, dict) else {}
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        for k, v in scaling.items():
            out.setdefault(k, v)
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    out.setdefault("rope_type", "default")
    if "rope_theta" not in out:
        out["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    prf = getattr(config, "partial_rotary_factor", None)
    if prf is not None:
        out.setdefault("partial_rotary_factor", prf)
    if out["rope_type"] == "llama3":
        out.setdefault("original_max_position_embeddings", getattr(config, "max_position_embeddings", None))
    return out


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(head_size: int, rotary_dim: int, max_position: int, rope_parameters: dict[str, Any] | None = None,
             is_neox_style: bool = True, dtype: torch.dtype = torch.float32, device=None) -> RotaryEmbedding:
    """A RotaryEmbedding; identical requests share one module (and one cos/sin cache) across layers."""
    params = rope_parameters or {"rope_type": "default"}
    dev = torch.device(device) if device is not None else torch.get_default_device()
    key = (head_size, rotary_dim, max_position, repr(sorted(params.items(), key=str)), is_neox_style, dtype, str(dev))
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = RotaryEmbedding(head_size, rotary_dim, max_position, params, is_neox_style=is_neox_style,
                               dtype=dtype, device=dev)
        _ROPE_CACHE[key] = rope
    return rope


def get_rope_from_config(config, head_dim: int, dtype: torch.dtype = torch.float32, device=None,
                         is_neox_style: bool = True) -> RotaryEmbedding:
    """The RotaryEmbedding an HF config asks for (rope_parameters/rope_scaling, rope_theta, partial_rotary_factor)."""
    params = rope_parameters_from_config(config)
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))
    max_position = int(getattr(config, "max_position_embeddings", 0) or 8192)
    return get_rope(head_dim, rotary_dim, max_position, params, is_neox_style=is_neox_style, dtype=dtype, device=device)
