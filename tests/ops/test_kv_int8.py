"""Quantized KV caches (int8, and fp8_e4m3 where torch has it): reshape_and_cache_quantized and the quantized
decode / prefill attention ops against the pure-torch reference, on random inputs.

Layout: values [num_blocks, num_kv_heads, block_size, head_dim] int8 / float8_e4m3fn, scales float32
[num_blocks, num_kv_heads, block_size] (one per (token, kv head) row), value = stored * scale.
Error bounds of the round trip (x -> stored, scale -> stored * scale), per element, absmax = the row's:
    int8: |x - x'| <= absmax / 254 (half a step of absmax / 127), plus fp32 rounding
    fp8:  |x - x'| <= max(|x| / 16, scale / 1024)  (3 mantissa bits: half an ulp; subnormal steps of
          scale * 2^-9)
Writes are bit-identical to the reference (the rule is a few correctly rounded fp32 operations).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagellm import ops
from pagellm.ops import reference as ref
from ops.op_helpers import assert_close, poison, random_block_tables, requires_ops, strided_heads

pytestmark = requires_ops
OP = torch.ops.pagellm

CACHE_DTYPES = [torch.int8] + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _empty_cache(num_blocks, num_kv_heads, block_size, head_dim, cache_dtype, device):
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    caches = [torch.zeros(shape, dtype=cache_dtype, device=device) for _ in range(2)]
    scales = [torch.zeros(shape[:3], device=device) for _ in range(2)]
    return caches[0], caches[1], scales[0], scales[1]


def _filled_cache(num_blocks, num_kv_heads, block_size, head_dim, cache_dtype, device, seed=0):
    """A quantized cache holding random rows of varied magnitude (through the reference write)."""
    g = torch.Generator().manual_seed(seed)
    n = num_blocks * block_size
    mag = torch.exp(torch.randn(n, num_kv_heads, 1, generator=g))  # row absmax spread over ~e^+-2
    k = (torch.randn(n, num_kv_heads, head_dim, generator=g) * mag).to(device)
    v = (torch.randn(n, num_kv_heads, head_dim, generator=g) * mag).to(device)
    cache = _empty_cache(num_blocks, num_kv_heads, block_size, head_dim, cache_dtype, device)
    ref.reshape_and_cache_quantized(*cache, k, v, torch.arange(n, device=device))
    return cache


# ------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_round_trip_error_bound(cache_dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=g) * torch.exp(2 * torch.randn(512, 1, generator=g))
    x[3] = 0.0  # a zero row: zeros, scale 0
    x[4, 7] = 1e4  # one outlier dominates its row's scale
    stored, scale = ref.quantize_kv_rows(x, cache_dtype)
    assert stored.dtype == cache_dtype and scale.shape == (512,) and scale.dtype == torch.float32
    back = stored.float() * scale[:, None]
    amax = x.abs().amax(-1, keepdim=True)
    err = (x - back).abs()
    if cache_dtype == torch.int8:
        assert stored.abs().max() <= 127
        bound = amax / 254 * (1 + 1e-5) + 1e-30
    else:
        bound = torch.maximum(x.abs() / 16, scale[:, None] / 1024) * (1 + 1e-5) + 1e-30
    assert (err <= bound).all(), float((err / bound).max())
    assert scale[3] == 0 and not _raw(stored[3]).any()
    torch.testing.assert_close(scale, amax[:, 0] / (127 if cache_dtype == torch.int8 else 448))


# ------------------------------------------------------------------------------------------ writes
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (3, 20, 8), (1, 128, 1), (4, 80, 32)])
def test_write_matches_reference_bit_for_bit(device, cache_dtype, dtype, num_kv_heads, head_dim, block_size):
    num_tokens = 23
    num_blocks = max(9, 2 * num_tokens // block_size)
    g = torch.Generator().manual_seed(head_dim)
    key = strided_heads(num_tokens, num_kv_heads, head_dim, dtype, device, seed=1).mul_(3)  # strided token rows
    value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * 0.01).to(dtype).to(device)
    key[5] = 0  # a zero row
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 11]] = -1  # padding tokens are skipped
    slots = slots.to(device)
    out = _filled_cache(num_blocks, num_kv_heads, block_size, head_dim, cache_dtype, device)
    expected = [t.clone() for t in out]
    ops.reshape_and_cache_quantized(*out, key, value, slots)
    ref.reshape_and_cache_quantized(*expected, key, value, slots)
    for a, b in zip(out, expected):
        assert torch.equal(_raw(a) if a.element_size() == 1 else a, _raw(b) if b.element_size() == 1 else b)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_streaming_writes_keep_earlier_rows(device, cache_dtype):
    """Token by token into one block, each larger than the last: a per-block scale fixed by the first
    token could not hold them; per-row scales leave every earlier row untouched and within the bound."""
    kc, vc, ks, vs = _empty_cache(2, 2, 16, 64, cache_dtype, device)
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randn(1, 2, 64, generator=g).to(device) * (4.0**i) for i in range(6)]
    for i, x in enumerate(tokens):
        before = _raw(kc).clone(), ks.clone()
        ops.reshape_and_cache_quantized(kc, vc, ks, vs, x, x, torch.tensor([16 + i], device=device))
        changed_rows = (_raw(kc) != before[0]).any(-1).nonzero()[:, [0, 2]].unique(dim=0).tolist()
        assert changed_rows in ([], [[1, i]])
        assert torch.equal(ks[:, :, :i], before[1][:, :, :i]) and torch.equal(ks[:, :, i + 1 :], before[1][:, :, i + 1 :])
    back = kc[1, :, :6].float() * ks[1, :, :6, None]
    for i, x in enumerate(tokens):
        amax = x[0].abs().amax(-1, keepdim=True)
        rel = 1 / 254 if cache_dtype == torch.int8 else 1 / 16
        assert ((back[:, i] - x[0]).abs() <= amax * rel * 1.001).all()


# -------------------------------------------------------------------------------------- attention
def _attention_inputs(device, seq_lens, num_kv_heads, head_dim, block_size, cache_dtype):
    tables, num_blocks = random_block_tables(seq_lens, block_size, seed=len(seq_lens))
    cache = _filled_cache(num_blocks, num_kv_heads, block_size, head_dim, cache_dtype, device, seed=head_dim)
    return cache, tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def _tol_scale(dtype: torch.dtype, device: str = "cpu") -> float:
    """The cached rows reach |x| ~ 20 (absmax spread e^+-2): fp32 summation-order differences grow with them, and
    more on CUDA, whose kernels scale each dot product by the key row's scale and take __expf (--use_fast_math)."""
    if dtype != torch.float32:  # CUDA's tensor-core kernel also rounds the probabilities to T for P @ V
        return 2.0 if device == "cuda" else 1.0
    return 10.0 if device == "cuda" else 5.0


DECODE_CASES = [
    # seq_lens, num_heads, num_kv_heads, head_dim, block_size, window, softcap
    ([1], 4, 4, 64, 16, -1, 0.0),  # MHA, one token
    ([15, 16, 17, 33], 8, 2, 80, 16, -1, 0.0),  # GQA 4, lengths around block boundaries
    ([129, 7], 14, 2, 112, 32, -1, 0.0),  # GQA 7
    ([300, 1, 64], 8, 1, 128, 8, -1, 0.0),  # MQA
    ([1000], 4, 2, 64, 16, -1, 0.0),  # long single sequence: split partitions + reduction
    ([40, 700], 8, 2, 64, 16, 16, 0.0),  # sliding window
    ([300, 17], 8, 2, 64, 4, 33, 30.0),  # window + soft-cap
]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_dim,block_size,window,softcap", DECODE_CASES)
def test_decode_matches_reference(device, cache_dtype, dtype, seq_lens, num_heads, num_kv_heads, head_dim,
                                  block_size, window, softcap):
    cache, tables, lens = _attention_inputs(device, seq_lens, num_kv_heads, head_dim, block_size, cache_dtype)
    query = strided_heads(len(seq_lens), num_heads, head_dim, dtype, device, seed=3)
    args = (*cache, tables, lens, 1.0 / math.sqrt(head_dim), window, softcap)
    out, expected = poison(torch.empty_like(query)), torch.empty_like(query)
    ops.paged_attention_decode_quantized(out, query, *args)
    ref.paged_attention_decode_quantized(expected, query, *args)
    assert_close(out, expected, scale=_tol_scale(dtype, device))


PREFILL_CASES = [
    # chunks (q_len, seq_len), num_heads, num_kv_heads, head_dim, block_size, window, softcap
    ([(1, 1)], 4, 4, 64, 16, -1, 0.0),
    ([(7, 7), (17, 40)], 8, 4, 80, 16, -1, 0.0),  # a prompt, and a chunk after a cached prefix
    ([(33, 33), (16, 16), (5, 100)], 16, 2, 128, 16, -1, 0.0),  # GQA 8, block boundaries
    ([(64, 200)], 8, 2, 64, 8, 24, 0.0),  # sliding window
    ([(20, 20), (9, 90)], 8, 1, 112, 32, 17, 20.0),  # MQA, window + soft-cap
]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("chunks,num_heads,num_kv_heads,head_dim,block_size,window,softcap", PREFILL_CASES)
def test_prefill_matches_reference(device, cache_dtype, dtype, chunks, num_heads, num_kv_heads, head_dim, block_size,
                                   window, softcap):
    seq_lens = [s for _, s in chunks]
    cache, tables, lens = _attention_inputs(device, seq_lens, num_kv_heads, head_dim, block_size, cache_dtype)
    qsl = torch.tensor([0] + torch.tensor([q for q, _ in chunks]).cumsum(0).tolist(), dtype=torch.int32, device=device)
    query = strided_heads(int(qsl[-1]), num_heads, head_dim, dtype, device, seed=4)
    args = (*cache, tables, qsl, lens, 1.0 / math.sqrt(head_dim), window, softcap)
    out, expected = poison(torch.empty_like(query)), torch.empty_like(query)
    ops.paged_attention_prefill_quantized(out, query, *args)
    if device == "cuda" and dtype != torch.float32:
        # The tensor-core kernel dequantizes K/V rows into tiles of the query's dtype (docs/cuda.md), so its
        # reference is float attention over those rounded rows. That rounding alone moves these outputs past the
        # bf16 / fp16 tolerance of the fp32-dequantized reference (rows up to |x| ~ 20 make the softmax sharp).
        kq, vq, ks, vs = cache
        kf, vf = ((c.float() * s[..., None]).to(dtype) for c, s in ((kq, ks), (vq, vs)))
        ref.paged_attention_prefill(expected, query, kf, vf, *args[4:])
    else:
        ref.paged_attention_prefill_quantized(expected, query, *args)
    assert_close(out, expected, scale=_tol_scale(dtype, device))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_quantized_attention_is_float_attention_of_the_dequantized_cache(device, cache_dtype):
    """The quantized ops read exactly stored * scale: the float ops over a float32 cache holding those values agree."""
    (kc, vc, ks, vs), tables, lens = _attention_inputs(device, [50, 9], 2, 64, 16, cache_dtype)
    kf, vf = kc.float() * ks[..., None], vc.float() * vs[..., None]
    query = torch.randn(2, 8, 64, device=device)
    out, expected = torch.empty_like(query), torch.empty_like(query)
    ops.paged_attention_decode_quantized(out, query, kc, vc, ks, vs, tables, lens, 0.125)
    ops.paged_attention_decode(expected, query, kf, vf, tables, lens, 0.125)
    assert_close(out, expected, scale=_tol_scale(torch.float32))
    qsl = torch.tensor([0, 10, 12], dtype=torch.int32, device=device)
    query = torch.randn(12, 8, 64, device=device)
    out, expected = torch.empty_like(query), torch.empty_like(query)
    ops.paged_attention_prefill_quantized(out, query, kc, vc, ks, vs, tables, qsl, lens, 0.125, 20)
    ops.paged_attention_prefill(expected, query, kf, vf, tables, qsl, lens, 0.125, 20)
    assert_close(out, expected, scale=_tol_scale(torch.float32))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_write_then_attend_stays_close_to_unquantized(device, cache_dtype):
    """End to end on one layer: quantized write + decode vs the float32 write + decode of the same K/V.
    Stated bound on unit-variance inputs: max |diff| < 0.02 (int8; measured 0.007) / 0.12 (fp8; measured 0.055)."""
    num_blocks, bs, H, D = 40, 16, 2, 128
    g = torch.Generator().manual_seed(7)
    seq_lens = [37, 300, 200]
    tables, _ = random_block_tables(seq_lens, bs, extra_blocks=num_blocks - 35)
    n = num_blocks * bs
    key, value = (torch.randn(n, H, D, generator=g).to(device) for _ in range(2))
    slots = torch.arange(n, device=device)
    q_cache = _empty_cache(num_blocks, H, bs, D, cache_dtype, device)
    kf, vf = (torch.zeros(num_blocks, H, bs, D, device=device) for _ in range(2))
    ops.reshape_and_cache_quantized(*q_cache, key, value, slots)
    ops.reshape_and_cache(kf, vf, key, value, slots)
    query = torch.randn(3, 8, D, generator=g).to(device)
    args = (tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), 1.0 / math.sqrt(D))
    out, expected = torch.empty_like(query), torch.empty_like(query)
    ops.paged_attention_decode_quantized(out, query, *q_cache, *args)
    ops.paged_attention_decode(expected, query, kf, vf, *args)
    bound = 0.02 if cache_dtype == torch.int8 else 0.12
    assert (out - expected).abs().max() < bound


# ------------------------------------------------------------------------------------------ errors
def test_python_wrapper_errors():
    kc, vc, ks, vs = _empty_cache(4, 2, 16, 64, torch.int8, "cpu")
    x, slots = torch.randn(3, 2, 64), torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="key_cache must have a quantized cache dtype"):
        ops.reshape_and_cache_quantized(kc.float(), vc.float(), ks, vs, x, x, slots)
    with pytest.raises(ValueError, match=r"k_scale shape \(4, 2\) must be \[num_blocks, num_kv_heads, block_size\]"):
        ops.reshape_and_cache_quantized(kc, vc, ks[..., 0], vs, x, x, slots)
    with pytest.raises(TypeError, match="v_scale must have dtype torch.float32"):
        ops.reshape_and_cache_quantized(kc, vc, ks, vs.double(), x, x, slots)
    with pytest.raises(TypeError, match="value_cache must have the dtype of key_cache"):
        ops.reshape_and_cache_quantized(kc, vc.view(torch.uint8), ks, vs, x, x, slots)
    with pytest.raises(TypeError, match="key must be float32, bfloat16 or float16"):
        ops.reshape_and_cache_quantized(kc, vc, ks, vs, x.double(), x, slots)
    q, bt, lens = torch.randn(1, 4, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="v_scale shape"):
        ops.paged_attention_decode_quantized(torch.empty_like(q), q, kc, vc, ks, vs[:, :1], bt, lens, 0.1)
    with pytest.raises(TypeError, match="query_start_loc"):
        ops.paged_attention_prefill_quantized(torch.empty_like(q), q, kc, vc, ks, vs, bt, torch.tensor([0, 1]), lens, 0.1)


def test_cpp_errors_name_the_argument():
    kc, vc, ks, vs = _empty_cache(4, 2, 16, 64, torch.int8, "cpu")
    x, slots = torch.randn(1, 2, 64), torch.tensor([0])
    q, bt, lens = torch.randn(1, 4, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    cases = [
        ("k_scale", lambda: OP.reshape_and_cache_quantized(kc, vc, ks[:, :1].contiguous(), vs, x, x, slots)),
        ("v_scale", lambda: OP.reshape_and_cache_quantized(kc, vc, ks, vs.transpose(1, 2), x, x, slots)),
        ("key_cache must be int8 or float8_e4m3fn", lambda: OP.reshape_and_cache_quantized(
            kc.float(), vc.float(), ks, vs, x, x, slots)),
        ("slot_mapping", lambda: OP.reshape_and_cache_quantized(kc, vc, ks, vs, x, x, torch.tensor([64]))),
        ("key", lambda: OP.reshape_and_cache_quantized(kc, vc, ks, vs, x.int(), x, slots)),
        ("value_cache", lambda: OP.paged_attention_decode_quantized(torch.empty_like(q), q, kc, vc.view(torch.uint8),
                                                                    ks, vs, bt, lens, 0.1)),
        ("block_tables", lambda: OP.paged_attention_decode_quantized(torch.empty_like(q), q, kc, vc, ks, vs,
                                                                     bt + 100, lens, 0.1)),
        ("k_scale", lambda: OP.paged_attention_prefill_quantized(torch.empty_like(q), q, kc, vc, ks.double(), vs, bt,
                                                                 torch.tensor([0, 1], dtype=torch.int32), lens, 0.1)),
    ]
    for name, fn in cases:
        with pytest.raises(RuntimeError, match=name):
            fn()
            pytest.fail(f"no error for a bad {name}")
