"""GGUF k-quants used natively (quantization="gguf"): a tiny random Llama written as a GGUF the way Q4_K_M files
are typed (Q4_K linears, Q6_K attn_v / ffn_down in some layers, a Q6_K LM head, a Q4_K embedding), loaded natively
vs through the dequantized path. Blocks come from the test quantizer (tests/ops/gguf_k_blocks.py): gguf-py does
not quantize k-quants.

Tolerance: float32, where the native kernels dequantize exactly as the dequantized path's weights were and
differ only in summation order: greedy tokens equal, prompt and sampled-token logprobs within 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf

from ops.gguf_k_blocks import quantize_k
from paged_model_utils import (
    available_backends, make_backend, make_tiny_hf, paged_greedy, paged_prompt_logprobs, random_prompts,
)
from pagellm.model_loader import build_model, open_model
from pagellm.ops.reference import gguf_dequantize
from pagellm.quantization import GGUFEmbeddingMethod, GGUFLinearMethod
from pagellm.quantization.gguf_mixed import GGUFMixedLinearMethod
from test_gguf import write_llama_gguf
from test_gguf_native import _generate

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# Q4_K_M-like: layer 0's attn_v is Q6_K beside Q4_K q / k (a merged qkv_proj of two types, one op call per shard)
LAYER_TYPES = [
    {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K,
     "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K},
    {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q4_K, "attn_output": Q.Q6_K, "ffn_gate": Q.Q6_K,
     "ffn_up": Q.Q6_K, "ffn_down": Q.Q4_K},
]
GLOBAL_TYPES = {"token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K}


def _quantize(array: np.ndarray, qtype) -> np.ndarray:
    if qtype in (Q.Q4_K, Q.Q6_K):
        return quantize_k(array, int(qtype))
    return gguf.quants.quantize(array, qtype)


def _qtype_of(name: str, gguf_name: str, array) -> object:
    if array.ndim != 2:
        return Q.F32
    if gguf_name in GLOBAL_TYPES:
        return GLOBAL_TYPES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.kind.weight
    return LAYER_TYPES[int(parts[1])].get(parts[2], Q.F32)


@pytest.fixture
def k_quant_gguf(tmp_path, monkeypatch, tiny_tokenizer):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    # hidden and intermediate sizes: multiples of 256, the k-quant super-block
    hf = make_tiny_hf(tf.LlamaConfig, tf.LlamaForCausalLM, seed=7, vocab_size=len(tiny_tokenizer), hidden_size=256,
                      intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_llama_gguf(path, hf, tiny_tokenizer, _qtype_of, _quantize)
    return path


def test_k_quant_layers_hold_the_files_blocks(k_quant_gguf):
    files = open_model(k_quant_gguf)
    native = build_model(files, "float32", quantization="gguf")
    deq = build_model(files, "float32")
    for i, types in enumerate(LAYER_TYPES):
        for merged, kind in (("self_attn.qkv_proj", "attn_q"), ("self_attn.o_proj", "attn_output"),
                             ("mlp.gate_up_proj", "ffn_gate"), ("mlp.down_proj", "ffn_down")):
            layer = native.get_submodule(f"model.layers.{i}.{merged}")
            ref = deq.get_submodule(f"model.layers.{i}.{merged}")
            if merged == "self_attn.qkv_proj" and types["attn_v"] != types["attn_q"]:
                method = layer.linear_method  # each shard's blocks, in its own type
                assert isinstance(method, GGUFMixedLinearMethod)
                assert [s.qtype for s in method.segments] == [int(types[k]) for k in ("attn_q", "attn_k", "attn_v")]
                assert torch.equal(method.dequantize(layer), ref.weight)
                continue
            assert isinstance(layer.linear_method, GGUFLinearMethod), (i, merged)
            assert layer.linear_method.type_name == types[kind].name
            assert not layer.linear_method.packed  # float32: the file's layout (packing is for half precision)
            w = gguf_dequantize(layer.qweight, layer.linear_method.qtype, layer.in_features)
            assert torch.equal(w, ref.weight), (i, merged)
    for name, gguf_name in (("model.embed_tokens", "token_embd.weight"), ("lm_head", "output.weight")):
        layer, ref = native.get_submodule(name), deq.get_submodule(name)
        assert isinstance(layer.linear_method, GGUFEmbeddingMethod), name
        assert layer.linear_method.type_name == GLOBAL_TYPES[gguf_name].name
        assert torch.equal(gguf_dequantize(layer.qweight, layer.linear_method.qtype, layer.in_features), ref.weight)
    ids = torch.tensor([[0, 3, files.hf_config.vocab_size - 1]])
    assert torch.equal(native.model.embed_tokens(ids), deq.model.embed_tokens(ids))


def test_k_quant_native_matches_dequantized_path(k_quant_gguf):
    files = open_model(k_quant_gguf)
    native = build_model(files, "float32", quantization="gguf")
    deq = build_model(files, "float32")
    be = make_backend("cpu" if "cpu" in available_backends() else available_backends()[0])
    prompts = random_prompts([5, 33, 70], files.hf_config.vocab_size, seed=4)  # prefill: M < 16 and M >= 16 paths
    for a, b in zip(paged_prompt_logprobs(native, be, prompts, 16), paged_prompt_logprobs(deq, be, prompts, 16)):
        assert (a - b).abs().max().item() < 1e-4
    assert paged_greedy(native, be, prompts, 24, 16) == paged_greedy(deq, be, prompts, 24, 16)


def test_llm_k_quant_native_equals_dequantized_fp32(k_quant_gguf):
    """Through LLM (decode steps replayed from step graphs): greedy tokens equal, logprobs within 1e-4."""
    tokens, lps, graphs = _generate(k_quant_gguf, "float32", quantization="gguf")
    ref_tokens, ref_lps, _ = _generate(k_quant_gguf, "float32")
    assert graphs.num_replays > 0
    assert tokens == ref_tokens
    for steps, ref_steps in zip(lps, ref_lps):
        for step, ref_step in zip(steps, ref_steps):
            assert step.keys() == ref_step.keys()
            assert max(abs(step[t] - ref_step[t]) for t in step) < 1e-4


def test_mixed_method_shards_bias_and_reference_fallback(monkeypatch):
    """GGUFMixedLinearMethod: shards loaded one by one (a wrong shape refused naming the shard), apply on
    [batch, seq, in] with a bias equals x @ W^T + b of gguf-py's dequantized shards, with the compiled op and with
    the pure-torch reference that runs when pagellm._C is missing."""
    from pagellm.layers import MergedLinear
    from pagellm.quantization import GGUFConfig
    from pagellm.quantization import gguf_op
    from pagellm.weight_utils import WeightShapeError

    config = GGUFConfig({"mlp.gate_up_proj": {0: "Q4_K", 1: "Q6_K"}})
    layer = MergedLinear(512, [40, 24], bias=True, quant_config=config, prefix="mlp.gate_up_proj")
    assert isinstance(layer.linear_method, GGUFMixedLinearMethod)
    assert tuple(layer.qweight.shape) == (40 * 2 * 144 + 24 * 2 * 210,)
    rng = np.random.default_rng(1)
    shards = [rng.standard_normal((40, 512)).astype(np.float32) / 20, rng.standard_normal((24, 512)).astype(np.float32)]
    blocks = [quantize_k(shards[0], int(Q.Q4_K)), quantize_k(shards[1], int(Q.Q6_K))]
    with pytest.raises(WeightShapeError, match=r"shard 1: expected uint8 blocks \[24, 420\]"):
        layer.weight_loader(layer.qweight, torch.from_numpy(blocks[0]), 1)
    for shard_id, b in enumerate(blocks):
        layer.weight_loader(layer.qweight, torch.from_numpy(b), shard_id)
        layer.weight_loader(layer.bias, torch.arange(len(b), dtype=torch.float32) / 10 * (shard_id + 1), shard_id)
    dense = torch.from_numpy(np.concatenate([gguf.quants.dequantize(b, t).reshape(-1, 512)
                                             for b, t in zip(blocks, (Q.Q4_K, Q.Q6_K))]))
    assert torch.equal(layer.linear_method.dequantize(layer), dense)
    for m in (3, 20):  # small-M and GEMM paths
        x = torch.randn(2, m, 512)
        expected = x @ dense.T + layer.bias
        torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)
        with monkeypatch.context() as patch:
            patch.setattr(gguf_op, "gguf_linear_op", gguf_op.reference_gguf_linear)
            torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)


def test_bf16_k_quant_layers_packed_give_the_unpacked_tokens(k_quant_gguf, monkeypatch):
    """On an AVX-512 VNNI CPU a bfloat16 model holds its Q4_K / Q6_K blocks row-packed (the mixed qkv shard by
    shard): unpacked they are the file's bytes, embedding lookups give the file's rows, and greedy tokens equal
    those of the same model with packing turned off (both quantize x to int8 per 32-block and make the same
    integer dots; only the fp32 summation order differs)."""
    from pagellm.quantization import gguf as gguf_method, gguf_mixed
    from pagellm.quantization.gguf_packing import packing_pays_off, unpack_rows

    if not packing_pays_off(torch.device("cpu"), torch.bfloat16):
        pytest.skip("packing applies to CPUs with AVX-512 VNNI (and no narrower PAGELLM_GGUF_CPU_ISA)")
    files = open_model(k_quant_gguf)
    packed = build_model(files, "bfloat16", quantization="gguf")
    with monkeypatch.context() as patch:
        for module in (gguf_method, gguf_mixed):
            patch.setattr(module, "packing_pays_off", lambda *args: False)
        plain = build_model(files, "bfloat16", quantization="gguf")
    packed_types, num_mixed = set(), 0
    for name, layer in packed.named_modules():
        method = getattr(layer, "linear_method", None)
        if not isinstance(method, (GGUFLinearMethod, GGUFMixedLinearMethod)):
            continue
        ref = plain.get_submodule(name)
        assert method.packed and not ref.linear_method.packed, name
        if isinstance(method, GGUFMixedLinearMethod):
            num_mixed += 1
            assert torch.equal(method.dequantize(layer), ref.linear_method.dequantize(ref)), name
            assert not hasattr(layer.qweight, "weight_loader")  # in-place updates refused
            continue
        assert torch.equal(unpack_rows(layer.qweight, method.qtype), ref.qweight), name
        packed_types.add(method.type_name)
    assert packed_types == {"Q4_K", "Q6_K"} and num_mixed == 1
    ids = torch.tensor([[0, 3, files.hf_config.vocab_size - 1]])
    assert torch.equal(packed.model.embed_tokens(ids), plain.model.embed_tokens(ids))
    be = make_backend("cpu")
    prompts = random_prompts([5, 33, 70], files.hf_config.vocab_size, seed=4)
    assert paged_greedy(packed, be, prompts, 24, 16) == paged_greedy(plain, be, prompts, 24, 16)


def test_llm_k_quant_bf16_replay_is_bit_identical_to_eager(k_quant_gguf):
    """bfloat16 (k-quant blocks row-packed on AVX-512 VNNI CPUs, the mixed qkv makes one call per shard): the
    replayed decode makes exactly the eager calls."""
    eager = _generate(k_quant_gguf, "bfloat16", quantization="gguf", enforce_eager=True)
    replayed = _generate(k_quant_gguf, "bfloat16", quantization="gguf")
    assert replayed[2].num_replays > 0
    assert replayed[:2] == eager[:2]
