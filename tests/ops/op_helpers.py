"""Helpers for the op tests: device list, paged-cache builders, tolerances, NaN poisoning."""

from __future__ import annotations

import pytest
import torch

from pagellm.ops import ops_available

_OK, _WHY = ops_available()
requires_ops = pytest.mark.skipif(not _OK, reason=_WHY or "pagellm._C not built")

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]

# The head dims the CUDA attention kernels are instantiated for (attention_head_dim_supported in csrc/ops/
# paged_attention/attention_launch.h); other head dims raise on CUDA, naming them.
CUDA_HEAD_DIMS = (64, 80, 96, 112, 128, 256)

# Absolute/relative tolerances per output dtype (both sides compute in fp32; bf16 differs by rounding).
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, scale: float = 1.0):
    atol, rtol = TOL[dtype or expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol * scale, rtol=rtol * scale)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fills with NaN so any element a kernel forgets to write fails the comparison."""
    return t.fill_(float("nan"))


def random_block_tables(seq_lens: list[int], block_size: int, extra_blocks: int = 3, seed: int = 0):
    """Shuffled, non-contiguous block assignment; tables padded with 0. Returns (tables int32, num_blocks)."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(max(need, default=1), 1) + 1  # padded column
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    pos = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[pos : pos + n], dtype=torch.int32)
        pos += n
    return tables, num_blocks


def random_caches(num_blocks, num_kv_heads, block_size, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k = torch.randn(shape, generator=g).to(dtype).to(device)
    v = torch.randn(shape, generator=g).to(dtype).to(device)
    return k, v


def strided_heads(num_tokens, num_heads, head_dim, dtype, device, extra_cols=48, seed=0):
    """[T, H, D] view into a wider buffer (token stride > H*D): exercises strided inputs."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(num_tokens, num_heads * head_dim + extra_cols, generator=g).to(dtype).to(device)
    return buf[:, extra_cols // 2 : extra_cols // 2 + num_heads * head_dim].view(num_tokens, num_heads, head_dim)
