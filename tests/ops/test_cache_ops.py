"""reshape_and_cache / copy_blocks / copy_slots against the reference."""

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


def _slot_caches(shapes_dtypes, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in shapes_dtypes:
        out.append((torch.randn(shape, generator=g) * 50).to(dtype))
    return out


@pytest.mark.parametrize("block_size,num_pairs,chained", [(1, 1, False), (16, 5, False), (16, 6, True), (8, 13, True)])
def test_copy_slots(block_size, num_pairs, chained):
    """Every cache tensor of a step (odd head counts and row widths, values and 3-dim scales, float / bf16 / int8)
    gets the reference's rows; chained pairs (a source that is an earlier pair's destination, as a tree path whose
    node j moves to slot j) read every source before writing; a destination named twice takes the later pair's."""
    num_blocks = 7
    shapes = [((num_blocks, 3, block_size, 37), torch.float32), ((num_blocks, 1, block_size, 80), torch.bfloat16),
              ((num_blocks, 3, block_size), torch.float32), ((num_blocks, 5, block_size, 2, 3), torch.int8)]
    g = torch.Generator().manual_seed(num_pairs)
    perm = torch.randperm(num_blocks * block_size, generator=g)
    dst = perm[:num_pairs]
    src = torch.roll(dst, 1) if chained else perm[num_pairs : 2 * num_pairs]  # chained: sources are destinations
    mapping = torch.stack([src, dst], dim=1)
    caches = _slot_caches(shapes, seed=block_size)
    expect = [c.clone() for c in caches]
    before = [c.clone() for c in caches]
    ops.copy_slots(caches, mapping)
    ref.copy_slots(expect, mapping)
    for got, want, old in zip(caches, expect, before):
        assert torch.equal(got, want)
        bs = old.shape[2]
        for s, d in mapping.tolist():  # the reference's meaning, spelled out: dst's rows are src's old rows
            assert torch.equal(got[d // bs, :, d % bs], old[s // bs, :, s % bs])
    ops.copy_slots(caches, mapping[:0])  # no pairs: nothing changes
    ops.copy_slots([], mapping)
    for got, want in zip(caches, expect):
        assert torch.equal(got, want)
    twice = torch.tensor([[int(src[0]), 3], [int(dst[0]), 3]])  # slot 3 named twice: the second pair's row
    old = [c.clone() for c in caches]
    ops.copy_slots(caches, twice)
    s = int(dst[0])
    for got, prev in zip(caches, old):
        bs = prev.shape[2]
        assert torch.equal(got[3 // bs, :, 3 % bs], prev[s // bs, :, s % bs])


def test_copy_slots_refuses_bad_input():
    cache = torch.randn(4, 2, 8, 16)
    keep = cache.clone()
    with pytest.raises(TypeError, match="slot_mapping"):
        ops.copy_slots([cache], torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(TypeError, match="caches"):
        ops.copy_slots(cache, torch.tensor([[0, 1]]))
    op = torch.ops.pagellm.copy_slots
    for mapping, match in ((torch.tensor([[0, 32]]), "out of range"), (torch.tensor([[-1, 3]]), "out of range"),
                           (torch.tensor([0, 1]), "num_pairs")):
        with pytest.raises(RuntimeError, match=match):
            op([cache], mapping)
    with pytest.raises(RuntimeError, match="caches"):
        op([cache.transpose(1, 2)], torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="caches"):
        op([torch.randn(4, 8)], torch.tensor([[0, 1]]))
    assert torch.equal(cache, keep)  # refused before any write
