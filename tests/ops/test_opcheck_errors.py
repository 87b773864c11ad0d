"""torch.library.opcheck on every op (schema, fake/meta, autograd registration, aot dispatch) and
clear errors for bad arguments (Python wrappers: TypeError/ValueError; C++ checks: RuntimeError)."""

from __future__ import annotations

import pytest
import torch

from pagellm import ops
from ops.op_helpers import random_block_tables, random_caches, requires_ops

pytestmark = requires_ops
OP = torch.ops.pagellm
CUDA_ONLY = {"linear_gemv", "rotary_embedding_and_cache", "rms_norm_linear", "silu_and_mul_linear"}


def _attn_inputs(dtype=torch.float32, chunks=((3, 9), (1, 4))):
    seq_lens = [s for _, s in chunks]
    tables, nb = random_block_tables(seq_lens, 4)
    kc, vc = random_caches(nb, 2, 4, 64, dtype, "cpu")
    qsl = torch.tensor([0] + torch.tensor([q for q, _ in chunks]).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), 4, 64).to(dtype)
    return q, kc, vc, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32)


def _cases():
    q, kc, vc, bt, qsl, lens = _attn_inputs()
    x = torch.randn(5, 128)
    w = torch.randn(128)
    cache = torch.randn(64, 32)
    yield "reshape_and_cache", (kc.clone(), vc.clone(), torch.randn(3, 2, 64), torch.randn(3, 2, 64), torch.tensor([0, -1, 5]))
    yield "copy_blocks", ([kc.clone()], [vc.clone()], torch.tensor([[0, 1]]))
    yield "copy_slots", ([kc.clone(), vc.clone()], torch.tensor([[0, 5], [5, 9]]))
    yield "paged_attention_decode", (torch.empty(2, 4, 64), q[:2].clone(), kc, vc, bt, lens, 0.125, -1, 0.0)
    yield "paged_attention_prefill", (torch.empty_like(q), q, kc, vc, bt, qsl, lens, 0.125, 4, 5.0)
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1], [1, 0, 0]], dtype=torch.bool)  # 3-node tree + 1 node
    latent = torch.randn(kc.shape[0], kc.shape[2], 48)  # MLA: one latent row of 48 per token, values its first 32
    yield "paged_mla_decode", (torch.empty(2, 3, 32), torch.randn(2, 3, 48), latent, bt, lens, 0.125)
    yield "paged_tree_attention", (torch.empty_like(q), q, kc, vc, bt, qsl, lens, tree_mask, 0.125, 5.0)
    kq, vq = (torch.randint(-127, 128, kc.shape, dtype=torch.int8) for _ in range(2))
    ks, vs = (torch.rand(kc.shape[:3]) / 50 for _ in range(2))
    yield "reshape_and_cache_quantized", (kq.clone(), vq.clone(), ks.clone(), vs.clone(), torch.randn(3, 2, 64),
                                          torch.randn(3, 2, 64), torch.tensor([0, -1, 5]))
    yield "paged_attention_decode_quantized", (torch.empty(2, 4, 64), q[:2].clone(), kq, vq, ks, vs, bt, lens, 0.125)
    yield "paged_attention_prefill_quantized", (torch.empty_like(q), q, kq, vq, ks, vs, bt, qsl, lens, 0.125, 4, 5.0)
    yield "rms_norm", (torch.empty_like(x), x, w, 1e-6)
    yield "fused_add_rms_norm", (x.clone(), x.clone(), w, 1e-6)
    yield "rotary_embedding", (torch.tensor([1, 7, 3]), torch.randn(3, 128), torch.randn(3, 64), 64, cache, True)
    yield "silu_and_mul", (torch.empty(5, 64), x)
    yield "gelu_and_mul", (torch.empty(5, 64), x, "tanh")
    yield "linear_small_m", (torch.empty(5, 24), x, torch.randn(24, 128), torch.randn(24))
    yield "linear_gemv", (torch.empty(5, 24), x, torch.randn(24, 128), torch.randn(24), 2, True)  # CUDA only
    # the fused CUDA-only ops (ops/fused_dispatch.py)
    yield "rotary_embedding_and_cache", (torch.tensor([1, 7, 3]), torch.randn(3, 256), torch.randn(3, 128),
                                         torch.randn(3, 128), kc.clone(), vc.clone(), torch.tensor([0, -1, 5]), 64,
                                         cache, True)
    yield "rms_norm_linear", (torch.empty(5, 24), torch.empty(5, 128), x, x.flip(0), w, 1e-6, torch.randn(24, 128),
                              torch.randn(24), 4, True)
    yield "silu_and_mul_linear", (torch.empty(5, 24), x, torch.randn(24, 64), None, 4, False)
    yield "argmax_rows", (torch.empty(5, dtype=torch.int64), x.to(torch.bfloat16))
    yield "linear_argmax", (torch.empty(5, dtype=torch.int64), x, torch.randn(24, 128), torch.randn(24))
    yield "linear_argmax", (torch.empty(1, dtype=torch.int64), x[:1].to(torch.bfloat16), torch.randn(37, 128).to(
        torch.bfloat16), None)  # one row: the fused path
    yield "gather_rows", (torch.empty(3, 128), x, torch.tensor([4, 0, 4]))
    xb = x.to(torch.bfloat16)
    yield "linear_amx", (torch.empty(5, 24, dtype=torch.bfloat16), xb, torch.randn(24, 128).to(xb.dtype), xb[0, :24])
    yield "bf16_dot_peak", (torch.empty(16), 3)
    x_outlier = x.clone()
    x_outlier[2, 7] = 9.0  # one outlier column (threshold 6)
    yield "int8_linear", (torch.empty(5, 24), x_outlier, torch.randint(-127, 128, (24, 128), dtype=torch.int8),
                          torch.rand(24) / 100, torch.randn(24), 6.0)
    yield "int8_linear", (torch.empty(5, 24), x_outlier, torch.randint(-127, 128, (24, 128), dtype=torch.int8),
                          torch.rand(24) / 100, None, 6.0, True)  # zero-point activation rows
    yield "int8_linear", (torch.empty(5, 24), x_outlier, torch.randint(-127, 128, (24, 128), dtype=torch.int8),
                          torch.rand(24) / 100, torch.randn(24), 6.0, False, 64)  # per-token groups of 64
    q4_1 = torch.randint(0, 256, (24, 4, 20), dtype=torch.uint8)  # 24 rows of 4 Q4_1 blocks: d, m (fp16), 16 qs
    q4_1[..., :4] = torch.full((24, 4, 2), 0.01, dtype=torch.float16).view(torch.uint8)
    yield "gguf_linear", (torch.empty(5, 24), x, q4_1.view(24, 80), 3, 128, torch.randn(24))
    # AWQ: N = 24, K = 128 (uint8 [N, K / 2]), two groups of 64 per row
    yield "awq_linear", (torch.empty(5, 24), x, torch.randint(0, 256, (24, 64), dtype=torch.uint8),
                         torch.rand(24, 2) / 100, torch.randint(0, 16, (24, 2), dtype=torch.uint8), 64, torch.randn(24))
    yield "lora_apply", (torch.randn(5, 24), x, torch.randn(3, 4, 128), torch.randn(3, 24, 4), torch.rand(3),
                         torch.tensor([0, -1, 2, 2, 1], dtype=torch.int32))
    # MoE: T = 5, H = 128, E = 4 experts of I = 24, k = 2 distinct experts per token
    yield "fused_moe", (x, torch.randn(4, 48, 128) / 10, torch.randn(4, 128, 24) / 10, torch.rand(5, 2),
                        torch.tensor([[0, 1], [2, 0], [3, 1], [1, 2], [0, 3]], dtype=torch.int32), "silu")


@pytest.mark.parametrize("name,args", list(_cases()), ids=[n for n, _ in _cases()])
def test_opcheck(name, args):
    if name == "linear_amx" and not ops.amx_available():
        pytest.skip("needs a CPU with AMX-BF16 (and a pagellm build that has it)")
    if name in CUDA_ONLY:  # registered for CUDA only
        if not torch.cuda.is_available():
            pytest.skip(f"{name} has a CUDA kernel only: needs a CUDA GPU")
        args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(getattr(OP, name).default, args)


def test_every_registered_op_is_opchecked():
    from pagellm.ops.fake import pagellm_op_names

    assert set(pagellm_op_names()) == {name for name, _ in _cases()}


def test_compile_rms_norm():
    """The fake impls let torch.compile trace the mutating ops."""
    x, w = torch.randn(4, 64), torch.randn(64)

    def f(x, w):
        out = torch.empty_like(x)
        ops.rms_norm(out, x, w, 1e-6)
        return out * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w), f(x, w))


# ---------------------------------------------------------------- errors


def test_python_wrapper_errors():
    q, kc, vc, bt, qsl, lens = _attn_inputs()
    out = torch.empty(2, 4, 64)
    with pytest.raises(TypeError, match="seq_lens"):
        ops.paged_attention_decode(out, q[:2], kc, vc, bt, lens.long(), 0.1)
    with pytest.raises(TypeError, match="key_cache"):
        ops.paged_attention_decode(out, q[:2], kc.double(), vc, bt, lens, 0.1)
    with pytest.raises(ValueError, match="out shape"):
        ops.paged_attention_decode(torch.empty(3, 4, 64), q[:2], kc, vc, bt, lens, 0.1)
    with pytest.raises(TypeError, match="input"):
        ops.silu_and_mul(torch.empty(2, 2, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="approximate"):
        ops.gelu_and_mul(torch.empty(2, 2), torch.zeros(2, 4), "fast")
    with pytest.raises(TypeError, match="slot_mapping"):
        ops.reshape_and_cache(kc, vc, torch.randn(3, 2, 64), torch.randn(3, 2, 64), torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="weight"):
        ops.rms_norm(torch.empty(2, 8), torch.randn(2, 8), torch.randn(8, dtype=torch.bfloat16), 1e-6)


def test_cpp_errors_name_the_argument():
    q, kc, vc, bt, qsl, lens = _attn_inputs()
    out = torch.empty(2, 4, 64)
    cases = [
        ("block_tables", lambda: OP.paged_attention_decode(out, q[:2], kc, vc, torch.full_like(bt, 10_000), lens, 0.1)),
        ("seq_lens", lambda: OP.paged_attention_decode(out, q[:2], kc, vc, bt, lens * 100, 0.1)),
        ("query", lambda: OP.paged_attention_decode(out, q[:2, :3], kc, vc, bt, lens, 0.1)),
        ("head_dim", lambda: OP.paged_attention_decode(out[..., :40], q[:2, :, :40], kc[..., :40].contiguous(), vc[..., :40].contiguous(), bt, lens, 0.1)),
        ("query_start_loc", lambda: OP.paged_attention_prefill(torch.empty_like(q), q, kc, vc, bt, qsl[:2], lens, 0.1)),
        ("window_size", lambda: OP.paged_attention_decode(out, q[:2], kc, vc, bt, lens, 0.1, 0)),
        ("slot_mapping", lambda: OP.reshape_and_cache(kc, vc, torch.randn(1, 2, 64), torch.randn(1, 2, 64), torch.tensor([10**6]))),
        ("key", lambda: OP.reshape_and_cache(kc, vc, torch.randn(1, 3, 64), torch.randn(1, 3, 64), torch.tensor([0]))),
        ("block_mapping", lambda: OP.copy_blocks([kc], [vc], torch.tensor([[0, 10**6]]))),
        ("key_cache", lambda: OP.reshape_and_cache(kc.transpose(1, 2), vc, torch.randn(1, 2, 64), torch.randn(1, 2, 64), torch.tensor([0]))),
        ("positions", lambda: OP.rotary_embedding(torch.tensor([100]), torch.randn(1, 64), torch.randn(1, 64), 64, torch.randn(10, 64), True)),
        ("head_size", lambda: OP.rotary_embedding(torch.tensor([1]), torch.randn(1, 64), torch.randn(1, 64), 48, torch.randn(10, 32), True)),
        ("weight", lambda: OP.rms_norm(torch.empty(2, 8), torch.randn(2, 8), torch.randn(9), 1e-6)),
        ("out", lambda: OP.silu_and_mul(torch.empty(2, 3), torch.randn(2, 8))),
        ("input", lambda: OP.silu_and_mul(torch.empty(2, 3), torch.randn(2, 7))),
        ("weight_scale", lambda: OP.int8_linear(torch.empty(2, 4), torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(3), None, 6.0)),
        ("threshold", lambda: OP.int8_linear(torch.empty(2, 4), torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4), None, -1.0)),
    ]
    for name, fn in cases:
        with pytest.raises(RuntimeError, match=name):
            fn()
            pytest.fail(f"no error for a bad {name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_mismatch_is_an_error():
    x = torch.randn(2, 8)
    with pytest.raises((RuntimeError, ValueError), match="weight|device"):
        ops.rms_norm(torch.empty_like(x), x, torch.randn(8, device="cuda"), 1e-6)
