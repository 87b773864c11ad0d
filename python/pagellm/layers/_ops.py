"""Which op implementation the layers call: `pagellm.ops` (C++ kernels) when pagellm._C is built,
otherwise `pagellm.ops.reference` (pure torch). The local pure-torch versions below (HF numerics)
are a last resort for any op neither provides."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from pagellm.logger import init_logger

logger = init_logger(__name__)

_NEEDED = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "gelu_and_mul")


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF order: fp32 variance, normalize in fp32, cast back, then multiply by the weight.
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm(out, input, weight, eps):
    out.copy_(_rms(input, weight, eps))


def fused_add_rms_norm(input, residual, weight, eps):
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps))


def _rotate(x, cos, sin, is_neox):
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    rot = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rot/2]
    cos, sin = cos[:, None, :].to(query.dtype), sin[:, None, :].to(query.dtype)
    for x in (query, key):
        if x is None:
            continue
        xv = x.view(x.shape[0], -1, head_size)
        xv[..., :rot] = _rotate(xv[..., :rot], cos, sin, is_neox)


def silu_and_mul(out, input):
    d = input.shape[-1] // 2
    out.copy_(F.silu(input[..., :d]) * input[..., d:])


def gelu_and_mul(out, input, approximate="none"):
    d = input.shape[-1] // 2
    out.copy_(F.gelu(input[..., :d], approximate=approximate) * input[..., d:])


_fallback = types.SimpleNamespace(**{n: globals()[n] for n in _NEEDED})


def _resolve() -> types.SimpleNamespace:
    """The compiled ops when pagellm._C loads, else `pagellm.ops.reference`, else the local fallbacks.

    Layers are internal callers on the per-token hot path, so they get the registered overloads
    (`torch.ops.pagellm.<name>.default`) rather than the validating Python wrappers of `pagellm.ops`:
    the C++ glue checks every argument anyway, and the wrappers cost a few microseconds per call,
    which adds up to milliseconds per decode step on a small model.
    """
    sources = []
    try:
        import pagellm.ops as compiled

        if compiled.ops_available()[0]:
            sources.append(types.SimpleNamespace(**{n: getattr(torch.ops.pagellm, n).default for n in _NEEDED}))
        else:
            logger.warning("pagellm ops: %s; using pagellm.ops.reference", compiled.ops_available()[1])
    except Exception as e:  # pragma: no cover
        logger.warning("pagellm.ops unavailable (%s)", e)
    try:
        import pagellm.ops.reference as reference

        sources.append(reference)
    except Exception:  # pragma: no cover
        pass
    sources.append(_fallback)
    return types.SimpleNamespace(
        **{n: next(getattr(s, n) for s in sources if getattr(s, n, None) is not None) for n in _NEEDED}
    )


ops = _resolve()
