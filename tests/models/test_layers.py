"""Layer units: rope caches vs transformers' rotary embedding, rope config parsing, partial/gptj rotary, loaders."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagellm.layers import MergedLinear, QKVLinear, WeightShapeError, get_rope, get_rope_from_config
from pagellm.layers.rotary import rope_parameters_from_config

ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_cache_matches_hf(kind):
    cfg = tf.LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=256,
                         rope_parameters=dict(ROPES[kind]))
    hf = LlamaRotaryEmbedding(cfg)
    pos = torch.arange(256)[None]  # within max_position_embeddings (dynamic == default there, as in HF)
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), pos)
    rope = get_rope_from_config(cfg, 64)
    half = rope.rotary_dim // 2
    ours = rope.cos_sin_cache[:256]
    assert torch.equal(ours[:, :half], cos[0, :, :half]) and torch.equal(ours[:, half:], sin[0, :, :half])
    # rotation in place == HF apply_rotary_pos_emb
    q = torch.randn(256, 2 * 64)
    k = torch.randn(256, 1 * 64)
    q_ref, k_ref = apply_rotary_pos_emb(q.view(1, 256, 2, 64).transpose(1, 2), k.view(1, 256, 1, 64).transpose(1, 2),
                                        cos, sin)
    rope(pos[0], q, k)
    torch.testing.assert_close(q.view(256, 2, 64), q_ref.transpose(1, 2)[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(k.view(256, 1, 64), k_ref.transpose(1, 2)[0], rtol=0, atol=1e-6)


def test_rope_config_old_and_new_style():
    class Old:  # transformers 4.x style
        rope_theta = 5000.0
        rope_scaling = {"type": "linear", "factor": 2.0}
        max_position_embeddings = 128

    p = rope_parameters_from_config(Old())
    assert p == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    new = tf.LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64})
    assert rope_parameters_from_config(new)["rope_type"] == "llama3"
    with pytest.raises(ValueError, match="unsupported rope_type"):
        get_rope(16, 16, 32, {"rope_type": "nope"})


def _complex_rope(x, pos, rot, base, neox):
    """Independent reference via complex multiplication."""
    inv = 1.0 / base ** (torch.arange(0, rot, 2).double() / rot)
    ang = pos[:, None].double() * inv[None]
    rotor = torch.polar(torch.ones_like(ang), ang)[:, None, :]
    xr = x[..., :rot].double()
    if neox:
        c = torch.complex(xr[..., : rot // 2], xr[..., rot // 2:]) * rotor
        xr = torch.cat([c.real, c.imag], -1)
    else:
        c = torch.complex(xr[..., 0::2], xr[..., 1::2]) * rotor
        xr = torch.stack([c.real, c.imag], -1).flatten(-2)
    return torch.cat([xr.float(), x[..., rot:]], -1)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot", [32, 16])
def test_partial_and_gptj_rotary(neox, rot):
    rope = get_rope(32, rot, 64, {"rope_type": "default", "rope_theta": 10000.0}, is_neox_style=neox)
    pos = torch.randint(0, 64, (7,))
    q, k = torch.randn(7, 3, 32), torch.randn(7, 1, 32)
    q_ref, k_ref = _complex_rope(q, pos, rot, 10000.0, neox), _complex_rope(k, pos, rot, 10000.0, neox)
    q2, k2 = q.reshape(7, -1).clone(), k.reshape(7, -1).clone()
    rope(pos, q2, k2)
    torch.testing.assert_close(q2.view(7, 3, 32), q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k2.view(7, 1, 32), k_ref, atol=1e-5, rtol=1e-5)


def test_merged_loaders():
    qkv = QKVLinear(8, 4, num_heads=2, num_kv_heads=1, bias=True)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for t, s in ((q, "q"), (k, "k"), (v, "v")):
        qkv.weight.weight_loader(qkv.weight, t, s)
    assert torch.equal(qkv.weight, torch.cat([q, k, v]))
    with pytest.raises(WeightShapeError, match=r"shard 'k'.*\(4, 8\).*\(5, 8\)"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(5, 8), "k")
    gu = MergedLinear(8, [6, 6])
    with pytest.raises(WeightShapeError):
        gu.weight.weight_loader(gu.weight, torch.randn(6, 7), 1)
