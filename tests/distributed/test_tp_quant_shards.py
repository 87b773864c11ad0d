"""How quantized linear methods and LoRA pairs are cut for tensor parallelism, in process: each rank of a fake
2-rank TensorParallelState builds the layer, loads the full checkpoint tensors through its weight_loader and
must hold exactly its slice (AWQ: packed int32 columns / whole groups; int8: the float slice quantized on
the rank; GGUF: rows of blocks / whole blocks of each row); the ranks' outputs, concatenated (column) or
summed (row), equal the unsplit layer's up to float32 summation order. Cuts that split a group, a block or
a packed int32 are refused at construction, before any weight is read, naming the layer."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagellm.distributed.parallel_state import TensorParallelState, set_tp_state
from pagellm.layers.linear import Linear, MergedLinear, QKVLinear
from pagellm.ops.reference import gguf_dequantize
from pagellm.quantization import GGUFConfig
from pagellm.quantization.awq import AWQConfig
from pagellm.quantization.awq_format import quantize_awq
from pagellm.quantization.int8 import Int8Config, quantize_weight_rows

TP = 2


@pytest.fixture
def on_rank():
    """on_rank(r): this process acts as rank r of TP ranks (no process group: nothing here communicates)."""
    def switch(rank: int) -> None:
        set_tp_state(TensorParallelState(rank, TP))

    yield switch
    set_tp_state(None)


def _load(layer, tensors: dict[str, torch.Tensor], shard_id=None) -> None:
    for name, t in tensors.items():
        layer.weight_loader(getattr(layer, name), t, shard_id)


def _finish(layer):
    layer.linear_method.process_weights_after_loading(layer)
    return layer


def _awq(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    qweight, qzeros, scales = quantize_awq(w, group)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales}


@pytest.mark.parametrize("group", [32, -1])
def test_awq_row_parallel_ranks_sum_to_the_whole_layer(on_rank, group):
    torch.manual_seed(0)
    w = torch.randn(40, 128)
    cfg, x = AWQConfig(group_size=group), torch.randn(3, 128)
    full = Linear(128, 40, quant_config=cfg, prefix="model.layers.0.mlp.down_proj")
    _load(full, _awq(w, 128 if group == -1 else group))
    _finish(full)
    partial = []
    for r in range(TP):
        on_rank(r)
        layer = Linear(128, 40, quant_config=cfg, prefix="model.layers.0.mlp.down_proj", tp_mode="row")
        _load(layer, _awq(w, 128 if group == -1 else group))
        assert tuple(layer.qweight.shape) == (64, 40 // 8)
        partial.append(_finish(layer).linear_method.apply(layer, x[:, r * 64 : (r + 1) * 64]))
    set_tp_state(None)
    torch.testing.assert_close(partial[0] + partial[1], full(x), atol=1e-4, rtol=1e-5)


def test_awq_qkv_column_parallel_ranks_hold_their_heads(on_rank):
    torch.manual_seed(1)
    head_dim, heads, kv_heads, hidden = 16, 4, 2, 64
    ws = {"q": torch.randn(heads * head_dim, hidden), "k": torch.randn(kv_heads * head_dim, hidden),
          "v": torch.randn(kv_heads * head_dim, hidden)}
    cfg, x = AWQConfig(group_size=32), torch.randn(5, hidden)
    full = QKVLinear(hidden, head_dim, heads, kv_heads, quant_config=cfg, prefix="model.layers.0.self_attn.qkv_proj")
    for sid, w in ws.items():
        _load(full, _awq(w, 32), sid)
    q, k, v = _finish(full).forward_split(x)
    for r in range(TP):
        on_rank(r)
        layer = QKVLinear(hidden, head_dim, heads, kv_heads, quant_config=cfg,
                          prefix="model.layers.0.self_attn.qkv_proj", tp_mode="column")
        for sid, w in ws.items():
            _load(layer, _awq(w, 32), sid)
        lq, lk, lv = _finish(layer).forward_split(x)
        torch.testing.assert_close(lq, q[:, r * 32 : (r + 1) * 32], atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(lk, k[:, r * 16 : (r + 1) * 16], atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(lv, v[:, r * 16 : (r + 1) * 16], atol=1e-4, rtol=1e-5)


def test_int8_quantizes_each_ranks_slice(on_rank):
    """Column-parallel ranks' rows quantize as the whole layer's do (the scale is per output row); a row-parallel
    rank's rows are quantized over its own input columns, so their scales are the slice's absmax, not the row's."""
    torch.manual_seed(2)
    w = torch.randn(24, 64)
    cfg = Int8Config()
    full = Linear(64, 24, quant_config=cfg, prefix="l")
    full.weight_loader(full.weight, w)
    for r in range(TP):
        on_rank(r)
        col = Linear(64, 24, quant_config=cfg, prefix="l", tp_mode="column")
        col.weight_loader(col.weight, w)
        assert torch.equal(col.weight, full.weight[r * 12 : (r + 1) * 12])
        assert torch.equal(col.weight_scale, full.weight_scale[r * 12 : (r + 1) * 12])
        row = Linear(64, 24, quant_config=cfg, prefix="l", tp_mode="row")
        row.weight_loader(row.weight, w)
        q, s = quantize_weight_rows(w[:, r * 32 : (r + 1) * 32])
        assert torch.equal(row.weight, q) and torch.equal(row.weight_scale, s)


def _gguf_blocks(w: np.ndarray, type_name: str) -> torch.Tensor:
    gguf = pytest.importorskip("gguf")
    if type_name in ("Q4_K", "Q6_K"):  # gguf-py does not quantize k-quants: the ops tests' own quantizer
        sys.path.insert(0, str(Path(__file__).parents[1] / "ops"))
        from gguf_k_blocks import quantize_k  # noqa: PLC0415

        return torch.from_numpy(quantize_k(w, int(gguf.GGMLQuantizationType[type_name])))
    return torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name]))


@pytest.mark.parametrize("type_name, in_features", [("Q8_0", 128), ("Q4_1", 128), ("Q4_K", 512)])
def test_gguf_row_parallel_ranks_hold_whole_blocks(on_rank, type_name, in_features):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((48, in_features)).astype(np.float32)
    blocks = _gguf_blocks(w, type_name)
    cfg = GGUFConfig({"o": type_name})
    full = Linear(in_features, 48, quant_config=cfg, prefix="o")
    full.weight_loader(full.qweight, blocks)
    _finish(full)
    qtype, x, half = full.linear_method.qtype, torch.randn(2, in_features), in_features // TP
    dense = gguf_dequantize(blocks, qtype, in_features)
    partial = []
    for r in range(TP):
        on_rank(r)
        layer = Linear(in_features, 48, quant_config=cfg, prefix="o", tp_mode="row")
        layer.weight_loader(layer.qweight, blocks)
        assert torch.equal(gguf_dequantize(layer.qweight, qtype, half), dense[:, r * half : (r + 1) * half])
        partial.append(_finish(layer).linear_method.apply(layer, x[:, r * half : (r + 1) * half]))
    set_tp_state(None)
    torch.testing.assert_close(partial[0] + partial[1], full(x), atol=1e-4, rtol=1e-5)


def test_gguf_mixed_column_parallel_shards(on_rank):
    rng = np.random.default_rng(4)
    ws = [rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal((32, 64)).astype(np.float32)]
    types = {0: "Q4_0", 1: "Q8_0"}
    blocks = [_gguf_blocks(w, types[i]) for i, w in enumerate(ws)]
    cfg, x = GGUFConfig({"gu": types}), torch.randn(3, 64)
    full = MergedLinear(64, [64, 32], quant_config=cfg, prefix="gu")
    for i, b in enumerate(blocks):
        full.weight_loader(full.qweight, b, i)
    y = full(x)
    for r in range(TP):
        on_rank(r)
        layer = MergedLinear(64, [64, 32], quant_config=cfg, prefix="gu", tp_mode="column")
        for i, b in enumerate(blocks):
            layer.weight_loader(layer.qweight, b, i)
        expected = torch.cat([y[:, r * 32 : (r + 1) * 32], y[:, 64 + r * 16 : 64 + (r + 1) * 16]], dim=1)
        torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)


def test_cuts_inside_a_group_block_or_packed_int_are_refused_at_construction(on_rank):
    on_rank(1)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.o_proj: in_features per tensor-parallel rank=32 "
                                         r"is not a multiple of the AWQ group_size 64"):
        Linear(64, 64, quant_config=AWQConfig(group_size=64), prefix="model.layers.0.self_attn.o_proj", tp_mode="row")
    with pytest.raises(ValueError, match=r"gate_up_proj: AWQ packs 8 output features per int32, but its output shards "
                                         r"have sizes per tensor-parallel rank \[12, 12\]"):
        MergedLinear(64, [24, 24], quant_config=AWQConfig(group_size=32), prefix="gate_up_proj", tp_mode="column")
    with pytest.raises(ValueError, match=r"down_proj: in_features per tensor-parallel rank=128 is not a multiple of "
                                         r"256, the Q4_K block size"):
        Linear(256, 64, quant_config=GGUFConfig({"down_proj": "Q4_K"}), prefix="down_proj", tp_mode="row")


def test_lora_pairs_are_cut_like_their_base_layer(on_rank):
    torch.manual_seed(5)
    a, b = torch.randn(4, 64), torch.randn(32, 4)
    for r in range(TP):
        on_rank(r)
        qkv = QKVLinear(64, 16, 4, 2, prefix="qkv", tp_mode="column")
        la, lb = qkv.tp_plan.slice_lora(a, b[:32], "k")  # k: 2 heads of 16, one per rank
        assert torch.equal(la, a) and torch.equal(lb, b[r * 16 : (r + 1) * 16])
        assert qkv.tp_plan.full_out_features("k", qkv.shard_offsets["k"][1]) == 32
        o = Linear(64, 32, prefix="o", tp_mode="row")
        la, lb = o.tp_plan.slice_lora(a, b, None)
        assert torch.equal(la, a[:, r * 32 : (r + 1) * 32]) and torch.equal(lb, b)
        assert o.tp_plan.full_in_features(o.in_features) == 64
