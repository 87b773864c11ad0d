"""The plumbing of the CUDA fusions that runs anywhere (layers/folded.py, ops/fused_dispatch.py, the attention
layer's rope hand-off): nothing folds on the CPU (its path is unchanged), a folded norm / activation materialized
gives the unfused op's bits and leaves its inputs alone, the switches refuse bad values, and a backend that writes
K/V together with the rope is then asked to attend without writing."""

from __future__ import annotations

import types

import pytest
import torch

from pagellm.layers.activation import GeluAndMul, SiluAndMul
from pagellm.layers.attention import Attention
from pagellm.layers.folded import FoldedNorm, FoldedSiluMul, fold_act, fold_norm, folds_into
from pagellm.layers.linear import Linear
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import get_rope
from pagellm.ops import fused_dispatch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nothing_folds_on_the_cpu(dtype):
    norm, lin = RMSNorm(64, dtype=dtype), Linear(64, 32, dtype=dtype)
    norm.weight.data.normal_()
    x, residual = torch.randn(1, 64).to(dtype), torch.randn(1, 64).to(dtype)
    assert not folds_into(lin, x, True)
    rows, res = fold_norm(norm, x.clone(), residual.clone(), lin)
    want_rows, want_res = norm(x.clone(), residual.clone())
    assert torch.equal(rows, want_rows) and torch.equal(res, want_res)
    rows, res = fold_norm(norm, x, None, lin)
    assert torch.equal(rows, norm(x)) and res is x
    gate_up = torch.randn(1, 64).to(dtype)
    assert torch.equal(fold_act(SiluAndMul(), gate_up, lin), SiluAndMul()(gate_up))
    assert torch.equal(fold_act(GeluAndMul(), gate_up, lin), GeluAndMul()(gate_up))
    assert not folds_into(None, x, True)


def test_materialized_rows_have_the_unfused_bits():
    norm = RMSNorm(96, eps=1e-5, dtype=torch.bfloat16)
    norm.weight.data.normal_()
    x, residual = torch.randn(3, 96).bfloat16(), torch.randn(3, 96).bfloat16()
    x0, r0 = x.clone(), residual.clone()
    folded = FoldedNorm(x, residual, norm.weight, norm.eps)
    assert folded.shape == x.shape and folded.dtype is x.dtype
    got = folded.materialize()
    want, want_res = norm(x0.clone(), r0.clone())
    assert torch.equal(got, want) and torch.equal(folded.residual_out, want_res)
    assert torch.equal(x, x0) and torch.equal(residual, r0)
    assert torch.equal(FoldedNorm(x, None, norm.weight, norm.eps).materialize(), norm(x))
    gate_up = torch.randn(2, 64).bfloat16()
    act = FoldedSiluMul(gate_up)
    assert tuple(act.shape) == (2, 32) and torch.equal(act.materialize(), SiluAndMul()(gate_up))


def test_switches_refuse_bad_values(monkeypatch):
    monkeypatch.setenv("PAGELLM_CUDA_FUSE_NORM_GEMV", "2")
    with pytest.raises(ValueError, match="PAGELLM_CUDA_FUSE_NORM_GEMV must be 0 or 1, got '2'"):
        fused_dispatch._switch("PAGELLM_CUDA_FUSE_NORM_GEMV")
    monkeypatch.setenv("PAGELLM_CUDA_FUSE_NORM_GEMV", "0")
    assert fused_dispatch._switch("PAGELLM_CUDA_FUSE_NORM_GEMV") is False


class _Recorder:
    """A backend stub: records what forward() got; rope_and_write says whether it did the rope + write itself."""

    def __init__(self, fuses: bool) -> None:
        self.fuses, self.calls = fuses, []

    def rope_and_write(self, layer, query, key, value, kv_cache, rotary_emb, positions) -> bool:
        return self.fuses

    def forward(self, layer, query, key, value, kv_cache):
        self.calls.append((query.clone(), key, value))
        return torch.zeros_like(query)


@pytest.mark.parametrize("fuses", [False, True])
def test_attention_hands_the_rope_to_the_backend(fuses):
    attn = Attention(0, num_heads=4, num_kv_heads=2, head_dim=16)
    rope = get_rope(16, 16, 64)
    q, k, v = torch.randn(3, 64), torch.randn(3, 32), torch.randn(3, 32)
    positions = torch.tensor([0, 5, 9])
    backend = _Recorder(fuses)
    ctx = types.SimpleNamespace(attn_backend=backend, kv_caches={0: object()})
    q_in, k_in = q.clone(), k.clone()
    attn(q, k, v, ctx, rope=(rope, positions))
    query, key, value = backend.calls[0]
    if fuses:  # the backend rotated and wrote: attention only
        assert key is None and value is None and torch.equal(query.reshape(3, 64), q_in)
    else:  # rotated here first (in place), then forward() writes
        rope(positions, q_in, k_in)
        assert torch.equal(query.reshape(3, 64), q_in) and torch.equal(key.reshape(3, 32), k_in)
