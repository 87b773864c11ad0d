"""paged_attention_decode / paged_attention_prefill against the reference, and the attention backends."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm import ops
from pagellm.ops import reference as ref
from ops.op_helpers import (
    CUDA_HEAD_DIMS, assert_close, poison, random_block_tables, random_caches, requires_ops, strided_heads,
)

pytestmark = requires_ops


def _decode_case(device, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, window=-1, softcap=0.0):
    tables, num_blocks = random_block_tables(seq_lens, block_size, seed=len(seq_lens))
    kc, vc = random_caches(num_blocks, num_kv_heads, block_size, head_dim, dtype, device, seed=head_dim)
    query = strided_heads(len(seq_lens), num_heads, head_dim, dtype, device, seed=3)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    tables = tables.to(device)
    scale = 1.0 / math.sqrt(head_dim)
    out, expected = poison(torch.empty_like(query)), torch.empty_like(query)
    ops.paged_attention_decode(out, query, kc, vc, tables, lens, scale, window, softcap)
    ref.paged_attention_decode(expected, query, kc, vc, tables, lens, scale, window, softcap)
    assert_close(out, expected)


@pytest.mark.parametrize(
    "seq_lens,num_heads,num_kv_heads,head_dim,block_size,dtype",
    [
        ([1], 8, 8, 64, 16, torch.float32),  # MHA, single token
        ([17, 5, 33], 8, 4, 80, 16, torch.bfloat16),  # GQA 2
        ([100, 1, 64], 16, 4, 96, 8, torch.float32),  # GQA 4
        ([129, 7], 14, 2, 112, 32, torch.bfloat16),  # GQA 7
        ([300], 16, 2, 128, 1, torch.bfloat16),  # GQA 8, block_size 1
        ([257, 40], 8, 1, 256, 256, torch.float32),  # MQA, block_size 256
        ([1000], 4, 4, 128, 64, torch.float16),  # long single sequence -> split partitions
        ([4000], 32, 8, 128, 16, torch.bfloat16),  # flash-decoding split + reduction
        ([3, 50, 700, 1, 129, 33, 64, 8, 2000], 12, 4, 64, 4, torch.bfloat16),  # ragged batch
    ],
)
def test_decode(device, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    _decode_case(device, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)


@pytest.mark.parametrize(
    "window,softcap,seq_lens",
    [(16, 0.0, [40, 10, 1000]), (5000, 0.0, [40, 700]), (-1, 30.0, [300, 17]), (33, 5.0, [129, 1, 2000])],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_window_softcap(device, window, softcap, seq_lens, dtype):
    _decode_case(device, seq_lens, 8, 2, 128, 16, dtype, window, softcap)


def _prefill_case(device, chunks, num_heads, num_kv_heads, head_dim, block_size, dtype, window=-1, softcap=0.0):
    """chunks: list of (q_len, seq_len); the cache holds every sequence's full context."""
    seq_lens = [s for _, s in chunks]
    tables, num_blocks = random_block_tables(seq_lens, block_size, seed=len(chunks))
    kc, vc = random_caches(num_blocks, num_kv_heads, block_size, head_dim, dtype, device, seed=head_dim)
    qsl = [0]
    for q_len, _ in chunks:
        qsl.append(qsl[-1] + q_len)
    query = strided_heads(qsl[-1], num_heads, head_dim, dtype, device, seed=4)
    args = (
        kc, vc, tables.to(device), torch.tensor(qsl, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), 1.0 / math.sqrt(head_dim), window, softcap,
    )  # fmt: skip
    out, expected = poison(torch.empty_like(query)), torch.empty_like(query)
    if device == "cuda" and head_dim not in CUDA_HEAD_DIMS:  # a clear refusal, naming the head dim
        with pytest.raises(RuntimeError, match=f"head_dim .* got {head_dim}"):
            ops.paged_attention_prefill(out, query, *args)
        return
    ops.paged_attention_prefill(out, query, *args)
    ref.paged_attention_prefill(expected, query, *args)
    assert_close(out, expected)


@pytest.mark.parametrize(
    "chunks,num_heads,num_kv_heads,head_dim,block_size,dtype",
    [
        ([(1, 1)], 4, 4, 64, 16, torch.float32),
        ([(7, 7), (17, 40)], 8, 4, 80, 16, torch.bfloat16),  # prompt + chunk after a cached prefix
        ([(129, 129)], 14, 2, 112, 8, torch.float32),  # GQA 7
        ([(33, 100), (1, 57), (64, 64)], 16, 2, 96, 32, torch.bfloat16),  # GQA 8, a 1-token chunk
        ([(50, 300)], 8, 1, 256, 256, torch.float32),  # MQA
        ([(20, 45)], 4, 1, 128, 1, torch.float16),  # block_size 1
        ([(1000, 1000)], 8, 2, 128, 16, torch.bfloat16),  # 1000-token prompt
        # bf16 with head_dim % 32 == 0 runs on AMX tiles where the CPU has them (prefill_amx_kernels.h):
        ([(45, 45), (3, 70), (31, 95)], 14, 2, 64, 16, torch.bfloat16),  # GQA 7: padded 16-row tiles
        ([(37, 61)], 9, 3, 64, 1, torch.bfloat16),  # SmolLM2's heads, block_size 1
        ([(17, 17)], 4, 4, 32, 4, torch.bfloat16),  # MHA, one 32-wide dim chunk
        ([(0, 10), (9, 9)], 4, 2, 64, 4, torch.float32),  # an empty chunk
        # more than 32 query rows per tile (GQA 36: 48 rows, GQA 64: 64): row blocks after the first 32
        ([(40, 60)], 36, 1, 64, 16, torch.float32),
        ([(5, 20), (3, 3)], 64, 1, 32, 16, torch.float32),
    ],
)
def test_prefill(device, chunks, num_heads, num_kv_heads, head_dim, block_size, dtype):
    _prefill_case(device, chunks, num_heads, num_kv_heads, head_dim, block_size, dtype)


@pytest.mark.parametrize(
    "window,softcap,chunks",
    [(16, 0.0, [(100, 150)]), (2000, 0.0, [(60, 60)]), (-1, 30.0, [(70, 90)]), (7, 10.0, [(40, 200), (1, 33)])],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_window_softcap(device, window, softcap, chunks, dtype):
    _prefill_case(device, chunks, 8, 2, 64, 16, dtype, window, softcap)


# bf16 caches on the CPU: the AVX512-BF16 kernel (prefill_bf16_kernels.h: 48-row query tiles, 64-key steps, bf16
# probabilities) where the avx512 library runs without AMX (with AMX, head_dim % 32 == 0 runs on tiles), and the
# fp32 FMA kernel (PAGELLM_PREFILL_BF16=0); both within the bf16 tolerance of the reference.
@pytest.mark.parametrize(
    "chunks,num_heads,num_kv_heads,head_dim,block_size",
    [
        ([(130, 130)], 9, 3, 64, 16),  # SmolLM2's heads: 48-row tiles, two 64-key steps and a 2-key tail
        ([(65, 65), (1, 66)], 10, 2, 80, 8),  # head_dim 80: a 16-dim last block of query pairs; a 1-token chunk
        ([(33, 161), (7, 7)], 16, 4, 128, 32),  # a chunk after a 128-token cached prefix
        ([(40, 60)], 36, 1, 64, 16),  # GQA 36: one token per tile, 36 of 48 rows
        ([(5, 20), (3, 3)], 64, 1, 32, 16),  # GQA 64: a 64-row tile
        ([(77, 77)], 6, 2, 96, 1),  # block_size 1: every key its own block
        ([(63, 200)], 8, 8, 16, 64),  # MHA, head_dim 16, wide blocks
    ],
)
@pytest.mark.parametrize("kernel", ["default", "fma"])
def test_prefill_bf16_cache_kernels(monkeypatch, kernel, chunks, num_heads, num_kv_heads, head_dim, block_size):
    if kernel == "fma":
        monkeypatch.setenv("PAGELLM_PREFILL_BF16", "0")  # read on every call
    _prefill_case("cpu", chunks, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16)


@pytest.mark.parametrize("window,softcap", [(16, 0.0), (70, 0.0), (-1, 30.0), (7, 10.0)])
def test_prefill_bf16_cache_window_softcap(window, softcap):
    """Windows that start inside and across the bf16 kernel's 64-key steps, soft-capped scores."""
    _prefill_case("cpu", [(150, 150), (20, 200), (1, 65)], 9, 3, 64, 16, torch.bfloat16, window, softcap)


# ---------------------------------------------------------------- backends through the interface


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_mixed_batch(backend_name, dtype):
    from pagellm.attention import AttentionLayerSpec, AttentionMetadata, get_attention_backend_cls
    from pagellm.kv_cache import FullAttentionSpec, PagedKVCache

    device = "cpu"
    cls = get_attention_backend_cls(backend_name)
    assert cls.is_available(torch.device(device))[0]
    backend = cls(torch.device(device))
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    # 3 decodes (context 20, 33, 1 -> query at the last position), then chunks (q_len, seq_len).
    decode_lens, chunks = [20, 33, 1], [(5, 5), (12, 40), (1, 17)]
    seq_lens = decode_lens + [s for _, s in chunks]
    q_lens = [1] * len(decode_lens) + [q for q, _ in chunks]
    tables, num_blocks = random_block_tables(seq_lens, block_size, seed=7)
    kc, vc = random_caches(num_blocks, num_kv_heads, block_size, head_dim, dtype, device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    num_tokens = sum(q_lens)
    slots = []
    for i, (q, s) in enumerate(zip(q_lens, seq_lens)):
        for p in range(s - q, s):
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
    md = AttentionMetadata(
        num_reqs=len(seq_lens), num_tokens=num_tokens, num_decode_reqs=len(decode_lens), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
    )  # fmt: skip
    layer = AttentionLayerSpec(0, num_heads, num_kv_heads, head_dim, scale=head_dim**-0.5, window_size=24, softcap=20.0)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    backend.plan(md)
    kv_cache = PagedKVCache(FullAttentionSpec(block_size, num_kv_heads, head_dim, dtype), kc, vc)
    out = backend.forward(layer, q, k, v, kv_cache)

    # Expected: write with the reference, then per-request attention.
    ref.reshape_and_cache(kc_ref, vc_ref, k, v, md.slot_mapping)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    expected = torch.empty_like(q)
    ref.paged_attention_prefill(
        expected, q, kc_ref, vc_ref, tables, md.query_start_loc, md.seq_lens, layer.scale, 24, 20.0
    )
    assert out.shape == q.shape
    assert_close(out, expected)
