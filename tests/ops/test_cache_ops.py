"""reshape_and_cache / copy_blocks against the reference."""

from __future__ import annotations

import pytest
import torch

from pagellm import ops
from pagellm.ops import reference as ref
from ops.op_helpers import requires_ops, strided_heads

pytestmark = requires_ops


@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim,block_size,dtype",
    [
        (1, 1, 64, 1, torch.float32),
        (7, 2, 80, 16, torch.bfloat16),
        (17, 8, 128, 32, torch.float16),
        (129, 4, 96, 256, torch.bfloat16),
        (1000, 2, 256, 8, torch.float32),
    ],
)
def test_reshape_and_cache(device, num_tokens, num_kv_heads, head_dim, block_size, dtype):
    num_blocks = (num_tokens + block_size - 1) // block_size + 4
    g = torch.Generator().manual_seed(num_tokens)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::5] = -1  # skipped tokens
    slots = slots.to(device)
    key = strided_heads(num_tokens, num_kv_heads, head_dim, dtype, device, seed=1)
    value = strided_heads(num_tokens, num_kv_heads, head_dim, dtype, device, seed=2)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    kc, vc = torch.randn(shape).to(dtype).to(device), torch.randn(shape).to(dtype).to(device)
    kr, vr = kc.clone(), vc.clone()
    ops.reshape_and_cache(kc, vc, key, value, slots)
    ref.reshape_and_cache(kr, vr, key, value, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.parametrize("num_layers,num_pairs,dtype", [(1, 1, torch.float32), (3, 5, torch.bfloat16)])
def test_copy_blocks(device, num_layers, num_pairs, dtype):
    num_blocks, shape = 16, (16, 2, 8, 64)
    g = torch.Generator().manual_seed(num_pairs)
    perm = torch.randperm(num_blocks, generator=g)
    mapping = torch.stack([perm[:num_pairs], perm[num_pairs : 2 * num_pairs]], dim=1).to(device)
    kcs = [torch.randn(shape).to(dtype).to(device) for _ in range(num_layers)]
    vcs = [torch.randn(shape).to(dtype).to(device) for _ in range(num_layers)]
    krs, vrs = [k.clone() for k in kcs], [v.clone() for v in vcs]
    ops.copy_blocks(kcs, vcs, mapping)
    ref.copy_blocks(krs, vrs, mapping)
    for a, b in zip(kcs + vcs, krs + vrs):
        assert torch.equal(a, b)
