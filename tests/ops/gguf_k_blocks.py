"""Test-side GGUF k-quant blocks: gguf-py (0.17) dequantizes Q4_K and Q6_K but does not quantize them, so the
tests write their own blocks. `quantize_q4_k` / `quantize_q6_k` are plain min-max quantizers (not llama.cpp's
error-minimizing search): their blocks are valid files' blocks whose values approximate the input, which is all a
test of the layout needs. `random_k_blocks` fills every byte at random (every scale, min and quant value occurs).
"""

from __future__ import annotations

import numpy as np
import torch

Q4_K, Q6_K = 12, 14
SUPER = 256
K_BLOCK_BYTES = {Q4_K: 144, Q6_K: 210}


def _safe(v: np.ndarray) -> np.ndarray:
    return np.where(v == 0, 1, v)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> uint8 [N, K / 256 * 144]: per 32-element sub-block a 6-bit scale and
    min (w ~ d sc q - dmin mn, q in 0..15), packed as gguf.quants.Q4_K.get_scale_min unpacks them."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    d = (((hi - lo) / 15).max(-1) / 63).astype(np.float16)
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round((hi - lo) / 15 / _safe(d.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / _safe(dmin.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    a = d.astype(np.float32)[:, None] * sc
    b = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((x + b[..., None]) / _safe(a)[..., None]), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)], axis=-1)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), scales, qs], -1)
    return blocks.reshape(n, k // SUPER * 144)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> uint8 [N, K / 256 * 210]: per 16 elements an int8 scale (w ~ d sc
    (q - 32), q in 0..63), the low 4 bits of q in ql and the high 2 in qh, as gguf.quants.Q6_K unpacks them."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.round(scale / _safe(d.astype(np.float32))[:, None]), -128, 127).astype(np.int8)
    a = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.round(x / _safe(a)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # [super-block, half of 128, quarter t of the half, l]: element 128 h + 32 t + l
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=-1).reshape(-1, 128)
    qh = sum(((q[:, :, t] >> 4) & 3) << (2 * t) for t in range(4)).astype(np.uint8).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)], axis=-1)
    return blocks.reshape(n, k // SUPER * 210)


def quantize_k(w: np.ndarray, qtype: int) -> np.ndarray:
    return quantize_q4_k(w) if qtype == Q4_K else quantize_q6_k(w)


def random_k_blocks(n: int, k: int, qtype: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, k / 256 * block_bytes]: every byte random, then fp16 d (and Q4_K's dmin) in [0.0005, 0.002] of
    either sign (real files' d is positive; the kernels must not care), so |w| stays below ~2."""
    g = torch.Generator().manual_seed(seed)
    nb, bb = k // SUPER, K_BLOCK_BYTES[qtype]
    blocks = torch.randint(0, 256, (n, nb, bb), generator=g, dtype=torch.uint8)

    def scale() -> torch.Tensor:
        sign = torch.randint(0, 2, (n, nb, 1), generator=g) * 2 - 1
        return ((torch.rand(n, nb, 1, generator=g) * 0.0015 + 0.0005) * sign).to(torch.float16).view(torch.uint8)

    if qtype == Q4_K:
        blocks[..., 0:2], blocks[..., 2:4] = scale(), scale()
    else:
        blocks[..., 208:210] = scale()
    return blocks.reshape(n, nb * bb)
