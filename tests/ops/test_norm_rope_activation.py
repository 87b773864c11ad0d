"""rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul, gelu_and_mul against the reference."""

from __future__ import annotations

import pytest
import torch

from pagellm import ops
from pagellm.ops import reference as ref
from ops.op_helpers import assert_close, poison, requires_ops

pytestmark = requires_ops

SIZES = [(1, 64), (7, 4096), (17, 80), (129, 1000), (1000, 256)]  # (tokens, hidden)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape, dtype, device, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize("tokens,hidden", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(device, tokens, hidden, dtype):
    x = _rand(tokens, hidden + 16, dtype=dtype, device=device)[:, 8 : 8 + hidden]  # strided rows
    w = _rand(hidden, dtype=dtype, device=device, seed=1)
    out, expected = poison(torch.empty(tokens, hidden, dtype=dtype, device=device)), torch.empty(tokens, hidden, dtype=dtype, device=device)
    ops.rms_norm(out, x, w, 1e-6)
    ref.rms_norm(expected, x, w, 1e-6)
    assert_close(out, expected)


@pytest.mark.parametrize("tokens,hidden", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(device, tokens, hidden, dtype):
    x = _rand(tokens, hidden, dtype=dtype, device=device)
    res = _rand(tokens, hidden, dtype=dtype, device=device, seed=2)
    w = _rand(hidden, dtype=dtype, device=device, seed=1)
    x_ref, res_ref = x.clone(), res.clone()
    ops.fused_add_rms_norm(x, res, w, 1e-5)
    ref.fused_add_rms_norm(x_ref, res_ref, w, 1e-5)
    assert torch.equal(res, res_ref)  # one rounding of the same fp32 sum
    assert_close(x, x_ref)


def test_rms_norm_matches_hf_rounding():
    """bf16: HF Llama normalizes in fp32, casts to bf16, THEN multiplies by the bf16 weight."""
    x = _rand(33, 512, dtype=torch.bfloat16, device="cpu")
    w = _rand(512, dtype=torch.bfloat16, device="cpu", seed=5)
    xf = x.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    mismatch = (out != hf).float().mean().item()
    assert mismatch < 0.01, mismatch  # rsqrt vs 1/sqrt may flip a rare last bit


@pytest.mark.parametrize(
    "tokens,num_heads,num_kv_heads,head_size,rot_dim,is_neox,layout,cache_dtype",
    [
        (1, 4, 4, 64, 64, True, "2d", "f32"),
        (7, 8, 2, 128, 128, False, "3d", "model"),
        (17, 4, 1, 80, 32, True, "qkv", "f32"),  # partial rotary, strided slices of a fused qkv
        (129, 6, 2, 96, 96, False, "qkv", "f32"),
        (1000, 4, 4, 256, 128, True, "2d", "model"),
        (5, 2, 2, 112, 112, False, "2d", "f32"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding(device, tokens, num_heads, num_kv_heads, head_size, rot_dim, is_neox, layout, cache_dtype, dtype):
    max_pos = 4096
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    cache = (cache if cache_dtype == "f32" else cache.to(dtype)).to(device)
    positions = torch.randint(0, max_pos, (tokens,), generator=torch.Generator().manual_seed(0)).to(device)
    qd, kd = num_heads * head_size, num_kv_heads * head_size
    if layout == "qkv":
        qkv = _rand(tokens, qd + 2 * kd, dtype=dtype, device=device)
        q, k = qkv[:, :qd], qkv[:, qd : qd + kd]
        v_before = qkv[:, qd + kd :].clone()
    elif layout == "3d":
        q = _rand(tokens, num_heads, head_size, dtype=dtype, device=device)
        k = _rand(tokens, num_kv_heads, head_size, dtype=dtype, device=device, seed=1)
    else:
        q = _rand(tokens, qd, dtype=dtype, device=device)
        k = _rand(tokens, kd, dtype=dtype, device=device, seed=1)
    q_ref, k_ref = q.clone(), k.clone()
    ops.rotary_embedding(positions, q, k, head_size, cache, is_neox)
    ref.rotary_embedding(positions, q_ref, k_ref, head_size, cache, is_neox)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    if layout == "qkv":
        assert torch.equal(qkv[:, qd + kd :], v_before)  # the value slice is untouched


@pytest.mark.parametrize("shape", [(1, 2 * 64), (7, 2 * 11008), (17, 2 * 80), (129, 2 * 1000), (1000, 2 * 24), (2, 3, 2 * 40)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_gated_activation(device, shape, dtype, act):
    x = _rand(*shape, dtype=dtype, device=device) * 3
    out = poison(torch.empty(*shape[:-1], shape[-1] // 2, dtype=dtype, device=device))
    expected = torch.empty_like(out)
    if act == "silu":
        ops.silu_and_mul(out, x)
        ref.silu_and_mul(expected, x)
    else:
        approx = "tanh" if act == "gelu_tanh" else "none"
        ops.gelu_and_mul(out, x, approx)
        ref.gelu_and_mul(expected, x, approx)
    assert_close(out, expected, scale=5.0 if dtype == torch.float32 else 1.0)
