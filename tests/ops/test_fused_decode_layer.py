"""fused_decode_layer (CPU) against its pure-torch reference, which composes the reference ops in the order of
pagellm/models/llama.py: random weights of odd sizes, GQA/MHA, biases, Qwen3's q/k norm, sliding window,
softcap, gelu, batch sizes on both sides of the small-M threshold. The output, the updated residual and
the written cache slots are all compared. (Bit-equality with the module path is tests/models/test_fused_decode.py.)
"""

from __future__ import annotations

import math

import pytest
import torch

from pagellm import ops
from pagellm.layers.rotary import get_rope
from pagellm.ops import reference as ref
from ops.op_helpers import assert_close, poison, random_block_tables, random_caches, requires_ops

pytestmark = requires_ops


def _layer_case(seq_lens, hidden, heads, kv_heads, head_dim, inter, dtype, *, bias=False, mlp_bias=False,
                qk_norm=False, window=-1, softcap=0.0, act="silu", block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=None):
        t = torch.randn(*shape, generator=g)
        return (t * (scale if scale is not None else 1.0 / math.sqrt(shape[-1]))).to(dtype)

    T = len(seq_lens)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    tables, num_blocks = random_block_tables(seq_lens, block_size, seed=seed)
    kc, vc = random_caches(num_blocks, kv_heads, block_size, head_dim, dtype, "cpu", seed=seed + 1)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    positions = (lens - 1).to(torch.int64)
    slots = torch.tensor([int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for i, n in enumerate(seq_lens)], dtype=torch.int64)
    rope = get_rope(head_dim, head_dim, max(seq_lens) + 8, {"rope_type": "default", "rope_theta": 10000.0},
                    dtype=dtype)
    weights = dict(
        qkv_weight=rnd(q_size + 2 * kv_size, hidden), qkv_bias=rnd(q_size + 2 * kv_size, scale=0.1) if bias else None,
        q_norm_weight=(1 + rnd(head_dim, scale=0.1)) if qk_norm else None,
        k_norm_weight=(1 + rnd(head_dim, scale=0.1)) if qk_norm else None,
        cos_sin_cache=rope.cos_sin_cache, is_neox=True, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        scale=head_dim**-0.5, window_size=window, softcap=softcap,
        o_weight=rnd(hidden, q_size), o_bias=rnd(hidden, scale=0.1) if bias else None,
        post_norm_weight=1 + rnd(hidden, scale=0.1), eps=1e-5,
        gate_up_weight=rnd(2 * inter, hidden), gate_up_bias=rnd(2 * inter, scale=0.1) if mlp_bias else None,
        down_weight=rnd(hidden, inter), down_bias=rnd(hidden, scale=0.1) if mlp_bias else None, act=act,
    )  # fmt: skip
    hidden_in = rnd(T, hidden, scale=1.0)
    residual = rnd(T, hidden, scale=1.0)

    results = []
    for impl in (ops.fused_decode_layer, ref.fused_decode_layer):
        k, v, res = kc.clone(), vc.clone(), residual.clone()
        out = poison(torch.empty(T, hidden, dtype=dtype))
        impl(out, hidden_in.clone(), res, positions, k, v, slots, tables, lens, **weights)
        results.append((out, res, k, v))
    (out, res, k, v), (ref_out, ref_res, ref_k, ref_v) = results
    assert_close(res, ref_res, scale=2)
    assert_close(k, ref_k)
    assert_close(v, ref_v)
    assert_close(out, ref_out, scale=4)  # bf16 roundings of three projections compound
    # every slot other than the written ones is untouched
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots] = True
    flat = k.permute(0, 2, 1, 3).reshape(num_blocks * block_size, -1)
    orig = kc.permute(0, 2, 1, 3).reshape(num_blocks * block_size, -1)
    assert torch.equal(flat[~written], orig[~written])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seq_lens,hidden,heads,kv_heads,head_dim,inter",
    [
        ([1], 48, 3, 1, 16, 40),  # MQA, first token
        ([37], 72, 6, 2, 48, 100),  # GQA 3, odd hidden / intermediate
        ([5, 129, 18], 64, 4, 4, 16, 90),  # MHA, batch 3
        ([3, 50, 17, 200, 9, 33], 96, 6, 2, 32, 130),  # batch 6: above the small-M threshold (at::linear)
    ],
)
def test_fused_decode_layer_matches_reference(dtype, seq_lens, hidden, heads, kv_heads, head_dim, inter):
    _layer_case(seq_lens, hidden, heads, kv_heads, head_dim, inter, dtype)


@pytest.mark.parametrize(
    "kw",
    [
        dict(bias=True),  # Qwen2: q/k/v bias (and o bias)
        dict(mlp_bias=True),
        dict(qk_norm=True),  # Qwen3
        dict(window=8),  # Mistral sliding window
        dict(softcap=20.0),
        dict(act="gelu"),
        dict(act="gelu_tanh", block_size=1),
    ],
)
def test_fused_decode_layer_variants(kw):
    _layer_case([3, 41, 17], 64, 4, 2, 16, 72, torch.bfloat16, seed=7, **kw)


def test_fused_decode_layer_bad_arguments():
    T, H = 2, 32
    x = torch.randn(T, H)
    kc = torch.zeros(4, 2, 16, 16)
    base = dict(out=torch.empty(T, H), hidden=x, residual=torch.zeros(T, H), positions=torch.zeros(T, dtype=torch.int64),
                key_cache=kc, value_cache=kc.clone(), slot_mapping=torch.zeros(T, dtype=torch.int64),
                block_tables=torch.zeros(T, 1, dtype=torch.int32), seq_lens=torch.ones(T, dtype=torch.int32),
                qkv_weight=torch.randn(4 * 16 + 2 * 2 * 16, H), qkv_bias=None, q_norm_weight=None, k_norm_weight=None,
                cos_sin_cache=torch.randn(8, 16), is_neox=True, num_heads=4, num_kv_heads=2, head_dim=16,
                scale=0.25, window_size=-1, softcap=0.0, o_weight=torch.randn(H, 64), o_bias=None,
                post_norm_weight=torch.ones(H), eps=1e-5, gate_up_weight=torch.randn(40, H), gate_up_bias=None,
                down_weight=torch.randn(H, 20), down_bias=None, act="silu")  # fmt: skip
    ops.fused_decode_layer(**base)  # the valid call runs
    with pytest.raises(ValueError, match="act"):
        ops.fused_decode_layer(**{**base, "act": "relu"})
    with pytest.raises(RuntimeError, match="qkv_weight"):
        ops.fused_decode_layer(**{**base, "qkv_weight": torch.randn(70, H)})
    with pytest.raises(RuntimeError, match="one token per sequence"):
        ops.fused_decode_layer(**{**base, "seq_lens": torch.ones(T + 1, dtype=torch.int32)})
    with pytest.raises(RuntimeError, match="down_weight"):
        ops.fused_decode_layer(**{**base, "down_weight": torch.randn(H + 1, 20)})
    with pytest.raises(TypeError, match="hidden"):
        ops.fused_decode_layer(**{**base, "hidden": x.to(torch.int32)})
