"""paged_mla_decode (torch.ops.pagellm): MLA decode over the paged latent cache, one KV head whose keys are the
latent rows and whose values are their first kv_lora_rank dims, against `mla_reference.paged_mla_decode`.

CPU: any latent_dim the CPU decode kernel takes (multiples of 16 up to 1024). CUDA: DeepSeek-V2/V3's widths,
latent_dim 576 (512 + 64 rope) for QK and kv_lora_rank 512 for the output; the CUDA cases skip without a GPU.
Covered: odd head counts (not a multiple of the kernel's 8 heads per CTA), block sizes 1 and 16, shuffled block
tables, contexts long enough for the CUDA split-context (flash-decoding) path, every float dtype, a query that is
a strided view, opcheck, the Python dispatch and bad input.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagellm.ops import mla as mla_ops
from pagellm.ops import mla_reference
from ops.op_helpers import DEVICES, TOL, poison, requires_ops

pytestmark = requires_ops
OP = torch.ops.pagellm
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
DEEPSEEK = (576, 512)  # (latent_dim, kv_lora_rank)
# (seq_lens, num_heads): short and odd; a 16-head DeepSeek-V2-Lite-like batch with a long context (splits on CUDA)
CASES = [([1, 15, 16, 17, 33, 5], 3), ([700, 2, 1500], 16), ([9], 20)]


def make_batch(seq_lens, num_heads, latent_dim, block_size, dtype, device, seed=0):
    """query [T, H, L], latent_cache [num_blocks, block_size, L] (unit-size rows scaled so softmax is not flat
    nor one-hot), shuffled block tables with a padding column, seq_lens int32."""
    g = torch.Generator().manual_seed(seed)
    width = max(math.ceil(n / block_size) for n in seq_lens) + 1
    num_blocks = width * len(seq_lens) + 2
    cache = torch.randn(num_blocks, block_size, latent_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: width * len(seq_lens)].view(len(seq_lens), width)
    query = torch.randn(len(seq_lens), num_heads, latent_dim, generator=g)
    return (query.to(dtype).to(device), cache.to(dtype).to(device), tables.to(torch.int32).to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device))


def widths(device):
    return [DEEPSEEK] if device == "cuda" else [DEEPSEEK, (48, 32)]


def check(out, query, cache, tables, lens, scale, rank):
    expected = mla_reference.paged_mla_decode(query.cpu(), cache.cpu(), tables.cpu(), lens.cpu(), scale, rank)
    atol, rtol = TOL[query.dtype]
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out.float().cpu(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=["short", "long", "heads20"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_op_matches_reference(device, dtype, case, block_size):
    seq_lens, num_heads = case
    for latent_dim, rank in widths(device):
        query, cache, tables, lens = make_batch(seq_lens, num_heads, latent_dim, block_size, dtype, device,
                                                seed=latent_dim + block_size)
        scale = 1.0 / math.sqrt(192)  # DeepSeek's 128 + 64 query head dim
        out = poison(torch.empty(len(seq_lens), num_heads, rank, dtype=dtype, device=device))
        OP.paged_mla_decode(out, query, cache, tables, lens, scale)
        check(out, query, cache, tables, lens, scale, rank)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_query_and_python_dispatch(device):
    """A query sliced out of a wider tensor (row strides > L); the wrapper picks paged_mla_decode at 576 / 512."""
    latent_dim, rank = DEEPSEEK
    query, cache, tables, lens = make_batch([40, 3], 5, latent_dim, 16, torch.bfloat16, device, seed=2)
    wide = torch.zeros(2, 5, latent_dim + 32, dtype=query.dtype, device=device)
    wide[..., 16 : 16 + latent_dim] = query
    assert mla_ops.decode_kernel(torch.device(device), latent_dim, rank) == "paged_mla_decode"
    out = mla_ops.paged_mla_decode(wide[..., 16 : 16 + latent_dim], cache, tables, lens, 0.1, rank)
    check(out, query, cache, tables, lens, 0.1, rank)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_opcheck(device, dtype):
    latent_dim, rank = DEEPSEEK
    query, cache, tables, lens = make_batch([5, 20], 3, latent_dim, 16, dtype, device, seed=4)
    out = torch.empty(2, 3, rank, dtype=dtype, device=device)
    torch.library.opcheck(OP.paged_mla_decode.default, (out, query, cache, tables, lens, 0.2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_refuses_other_widths_and_the_wrapper_falls_back():
    """The CUDA kernel is DeepSeek's 576 / 512 only: other widths raise naming them; the wrapper routes them to
    paged_attention_decode (its head dims) or the masked torch decode, still matching the reference."""
    query, cache, tables, lens = make_batch([7, 30], 4, 80, 16, torch.float32, "cuda", seed=6)
    out = torch.empty(2, 4, 64, device="cuda")
    with pytest.raises(RuntimeError, match="latent_dim 576 and kv_lora_rank"):
        OP.paged_mla_decode(out, query, cache, tables, lens, 0.2)
    assert mla_ops.decode_kernel(torch.device("cuda"), 80, 64) == "paged_attention_decode"
    assert mla_ops.decode_kernel(torch.device("cuda"), 576, 448) is None
    check(mla_ops.paged_mla_decode(query, cache, tables, lens, 0.2, 64), query, cache, tables, lens, 0.2, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(out=lambda a: a["out"][..., :0]), "kv_lora_rank in"),
        (dict(out=lambda a: a["out"].double()), "out"),
        (dict(latent_cache=lambda a: a["latent_cache"][..., :64]), "latent_cache|query's last dim"),
        (dict(latent_cache=lambda a: a["latent_cache"][:, :12]), "block_size|contiguous"),
        (dict(block_tables=lambda a: a["block_tables"].long()), "block_tables"),
        (dict(seq_lens=lambda a: a["seq_lens"][:1]), "seq_lens"),
        (dict(query=lambda a: a["query"][:, :2]), "out must have shape"),
    ],
    ids=["rank0", "out-dtype", "latent-width", "block-size", "tables-dtype", "lens-shape", "heads"],
)
def test_bad_input_raises_and_leaves_out(device, change, match):
    query, cache, tables, lens = make_batch([3, 9], 3, 576, 16, torch.float32, device, seed=8)
    args = dict(out=torch.zeros(2, 3, 512, device=device), query=query, latent_cache=cache, block_tables=tables,
                seq_lens=lens)
    before = args["out"].clone()
    (name, fn), = change.items()
    args[name] = fn(args)
    with pytest.raises(RuntimeError, match=match):
        OP.paged_mla_decode(args["out"], args["query"], args["latent_cache"], args["block_tables"], args["seq_lens"],
                            0.2)
    if name != "out":
        assert torch.equal(args["out"], before)
