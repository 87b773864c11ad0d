"""GGUF blocks used natively (quantization="gguf"): a tiny random Llama written as a GGUF with Q8_0 / Q4_0 / Q4_1
(and one F16) linears, loaded natively vs through today's dequantized path; the default model the same way; bad
files refused before the model is built.

Tolerance: in float32 the native kernels dequantize exactly as the dequantized path's weights were, and differ
only in summation order, so greedy tokens are equal and prompt logprobs within 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf

from paged_model_utils import (
    available_backends, make_backend, make_tiny_hf, paged_greedy, paged_prompt_logprobs, random_prompts,
)
from pagellm import LLM, SamplingParams
from pagellm.model_loader import build_model, open_model
from pagellm.models.llama import LlamaForCausalLM
from pagellm.ops.reference import gguf_dequantize
from pagellm.quantization import GGUFConfig, GGUFEmbeddingMethod, GGUFLinearMethod, UnquantizedLinearMethod
from test_gguf import write_llama_gguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# per layer: the GGUF type of each linear kind (shards of one merged layer share a type); F16 stays a float layer
LAYER_TYPES = [
    {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_1,
     "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0},
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1, "ffn_gate": Q.Q8_0,
     "ffn_up": Q.Q8_0, "ffn_down": Q.F16},
    {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_0,
     "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1},
]
GLOBAL_TYPES = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q4_1, "output_norm.weight": Q.F32}


def write_gguf(path, hf, tokenizer, layer_types=LAYER_TYPES) -> None:
    """hf's weights as a llama GGUF, each tensor in the type the tables say."""

    def qtype_of(name: str, gguf_name: str, array) -> object:
        if gguf_name in GLOBAL_TYPES:
            return GLOBAL_TYPES[gguf_name]
        parts = gguf_name.split(".")  # blk.N.kind.weight
        return layer_types[int(parts[1])].get(parts[2], Q.F32)

    write_llama_gguf(path, hf, tokenizer, qtype_of)


def tiny_hf(tokenizer):
    return make_tiny_hf(tf.LlamaConfig, tf.LlamaForCausalLM, seed=5, vocab_size=len(tokenizer), hidden_size=64,
                        intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def tiny_gguf(tmp_path, cache, tiny_tokenizer):
    path = tmp_path / "tiny-native.gguf"
    write_gguf(path, tiny_hf(tiny_tokenizer), tiny_tokenizer)
    return path


def test_native_layers_hold_the_files_blocks(tiny_gguf):
    files = open_model(tiny_gguf)
    native = build_model(files, "float32", quantization="gguf")
    deq = build_model(files, "float32")
    reader = gguf.GGUFReader(str(tiny_gguf))
    types = {t.name: t.tensor_type for t in reader.tensors}
    for i in range(3):
        for merged, kind in (("self_attn.qkv_proj", "attn_q"), ("self_attn.o_proj", "attn_output"),
                             ("mlp.gate_up_proj", "ffn_gate"), ("mlp.down_proj", "ffn_down")):
            layer = native.get_submodule(f"model.layers.{i}.{merged}")
            ref = deq.get_submodule(f"model.layers.{i}.{merged}")
            if types[f"blk.{i}.{kind}.weight"] == Q.F16:
                assert isinstance(layer.linear_method, UnquantizedLinearMethod)
                assert torch.equal(layer.weight, ref.weight)
                continue
            assert isinstance(layer.linear_method, GGUFLinearMethod)
            assert layer.linear_method.type_name == types[f"blk.{i}.{kind}.weight"].name
            assert layer.qweight.dtype == torch.uint8
            # the same values as the dequantized path (q/k rows un-permuted as whole rows of blocks)
            w = gguf_dequantize(layer.qweight, layer.linear_method.qtype, layer.in_features)
            assert torch.equal(w, ref.weight), merged
    # the embedding (Q8_0 in the file) and the untied LM head (Q4_1) keep their blocks too
    for name, gguf_name in (("model.embed_tokens", "token_embd.weight"), ("lm_head", "output.weight")):
        layer, ref = native.get_submodule(name), deq.get_submodule(name)
        assert isinstance(layer.linear_method, GGUFEmbeddingMethod), name
        assert layer.linear_method.type_name == types[gguf_name].name
        assert torch.equal(gguf_dequantize(layer.qweight, layer.linear_method.qtype, layer.in_features), ref.weight)


def test_bf16_layers_are_row_packed_on_vnni_cpus(tiny_gguf):
    """A half-precision model on an AVX-512 VNNI CPU holds its blocks row-packed for the VNNI kernel: unpacked
    they are the file's bytes; embedding lookups still give the file's rows; in-place weight updates are
    refused (they would write file-layout rows into packed groups); float32 models keep the file's layout."""
    from pagellm.engine.weight_update import WeightUpdateError, plan_weight_update
    from pagellm.quantization.gguf_packing import packing_pays_off, unpack_rows

    if not packing_pays_off(torch.device("cpu"), torch.bfloat16):
        pytest.skip("packing applies to CPUs with AVX-512 VNNI (and no narrower PAGELLM_GGUF_CPU_ISA)")
    files = open_model(tiny_gguf)
    packed = build_model(files, "bfloat16", quantization="gguf")
    plain = build_model(files, "float32", quantization="gguf")
    num_packed = 0
    for name, layer in packed.named_modules():
        method = getattr(layer, "linear_method", None)
        if not isinstance(method, GGUFLinearMethod):
            continue
        ref = plain.get_submodule(name)
        assert not ref.linear_method.packed
        num_packed += method.packed
        assert method.packed == (layer.out_features >= 16), name
        assert torch.equal(unpack_rows(layer.qweight, method.qtype), ref.qweight), name
    assert num_packed > 0
    ids = torch.tensor([[0, 5, files.hf_config.vocab_size - 1]])
    torch.testing.assert_close(packed.model.embed_tokens(ids).float(),
                               plain.model.embed_tokens(ids).to(torch.bfloat16).float(), rtol=0, atol=0)
    qkv = packed.model.layers[0].self_attn.qkv_proj
    if isinstance(qkv.linear_method, GGUFLinearMethod) and qkv.linear_method.packed:
        with pytest.raises(WeightUpdateError, match="repacked"):
            plan_weight_update(packed, [("model.layers.0.self_attn.q_proj.qweight", torch.zeros(1))])


def test_native_matches_dequantized_path(tiny_gguf):
    files = open_model(tiny_gguf)
    native = build_model(files, "float32", quantization="gguf")
    deq = build_model(files, "float32")
    be = make_backend("cpu" if "cpu" in available_backends() else available_backends()[0])
    prompts = random_prompts([5, 33, 70], files.hf_config.vocab_size, seed=4)  # prefill: M < 16 and M >= 16 paths
    for a, b in zip(paged_prompt_logprobs(native, be, prompts, 16), paged_prompt_logprobs(deq, be, prompts, 16)):
        assert (a - b).abs().max().item() < 1e-4
    assert paged_greedy(native, be, prompts, 24, 16) == paged_greedy(deq, be, prompts, 24, 16)


def _generate(path, dtype, **kwargs):
    llm = LLM(str(path), dtype=dtype, num_kv_blocks=64, block_size=16, max_model_len=256, max_num_seqs=4, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2, detokenize=False)
    prompts = random_prompts([4, 19, 40], 300, seed=9)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs, llm.llm_engine.runner.step_graphs


def test_llm_native_equals_dequantized_fp32(tiny_gguf):
    """Through LLM (decode steps replayed from step graphs): greedy tokens equal, logprobs within 1e-4."""
    tokens, lps, graphs = _generate(tiny_gguf, "float32", quantization="gguf")
    ref_tokens, ref_lps, _ = _generate(tiny_gguf, "float32")
    assert graphs.num_replays > 0
    assert tokens == ref_tokens
    for steps, ref_steps in zip(lps, ref_lps):
        for step, ref_step in zip(steps, ref_steps):
            assert step.keys() == ref_step.keys()
            assert max(abs(step[t] - ref_step[t]) for t in step) < 1e-4


def test_llm_native_bf16_replay_is_bit_identical_to_eager(tiny_gguf):
    """bfloat16 (int8 activations on VNNI CPUs): the replayed decode makes exactly the eager calls."""
    eager = _generate(tiny_gguf, "bfloat16", quantization="gguf", enforce_eager=True)
    replayed = _generate(tiny_gguf, "bfloat16", quantization="gguf")
    assert replayed[2].num_replays > 0
    assert replayed[:2] == eager[:2]


def test_linear_method_shards_bias_and_reference_fallback(monkeypatch):
    """A merged GGUF layer loads each shard's block rows into its row range; apply on [batch, seq, in] with a
    bias equals the pure-torch reference, which is also what apply runs when pagellm._C is missing."""
    from pagellm.layers import MergedLinear
    from pagellm.quantization import gguf_op

    config = GGUFConfig({"mlp.gate_up_proj": "Q4_1"})
    layer = MergedLinear(96, [40, 24], bias=True, quant_config=config, prefix="mlp.gate_up_proj")
    assert isinstance(layer.linear_method, GGUFLinearMethod) and tuple(layer.qweight.shape) == (64, 3 * 20)
    rng = np.random.default_rng(1)
    shards = [rng.standard_normal((40, 96)).astype(np.float32), rng.standard_normal((24, 96)).astype(np.float32)]
    for shard_id, w in enumerate(shards):
        layer.weight_loader(layer.qweight, torch.from_numpy(gguf.quants.quantize(w, Q.Q4_1)), shard_id)
        layer.weight_loader(layer.bias, torch.arange(len(w), dtype=torch.float32) / 10 * (shard_id + 1), shard_id)
    dense = np.concatenate([gguf.quants.dequantize(gguf.quants.quantize(w, Q.Q4_1), Q.Q4_1) for w in shards])
    assert torch.equal(gguf_dequantize(layer.qweight, 3, 96), torch.from_numpy(dense).reshape(64, 96))
    x = torch.randn(2, 5, 96)
    expected = x @ torch.from_numpy(dense).reshape(64, 96).T + layer.bias
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)
    monkeypatch.setattr(gguf_op, "gguf_linear_op", gguf_op.reference_gguf_linear)
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)


# ---- bad input ----------------------------------------------------------------------------------
def _refuse_construction(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was constructed before the file was checked")

    monkeypatch.setattr(LlamaForCausalLM, "__init__", fail)


def test_unsupported_type_is_refused_before_building(tmp_path, cache, tiny_tokenizer, monkeypatch):
    types = [dict(t) for t in LAYER_TYPES]
    types[2]["ffn_up"] = types[2]["ffn_gate"] = Q.Q5_0
    path = tmp_path / "q5.gguf"
    write_gguf(path, tiny_hf(tiny_tokenizer), tiny_tokenizer, types)
    files = open_model(path)  # the dequantized path reads it fine
    _refuse_construction(monkeypatch)
    with pytest.raises(ValueError, match=r"'blk\.2\.ffn_(gate|up)\.weight' is stored as Q5_0.*"
                                         r"\['Q4_0', 'Q4_1', 'Q8_0', 'Q4_K', 'Q6_K'\]"):
        build_model(files, "float32", quantization="gguf")


def test_merged_layer_shards_of_different_types(tmp_path, cache, tiny_tokenizer):
    """A merged layer whose shards differ in block type (layer 1: q / v Q4_0, k Q8_0) keeps each shard's blocks;
    one mixing a float shard with a block shard (layer 2: gate F16, up Q4_0) loads as float weights, that layer
    only. Both hold the dequantized path's values, and the model's logits match it."""
    from pagellm.quantization.gguf_mixed import GGUFMixedLinearMethod

    types = [dict(t) for t in LAYER_TYPES]
    types[1]["attn_k"] = Q.Q8_0
    types[2]["ffn_gate"] = Q.F16
    path = tmp_path / "mixed.gguf"
    write_gguf(path, tiny_hf(tiny_tokenizer), tiny_tokenizer, types)
    files = open_model(path)
    native, deq = build_model(files, "float32", quantization="gguf"), build_model(files, "float32")
    qkv = native.get_submodule("model.layers.1.self_attn.qkv_proj")
    assert isinstance(qkv.linear_method, GGUFMixedLinearMethod)
    assert [s.qtype for s in qkv.linear_method.segments] == [2, 8, 2]
    assert torch.equal(qkv.linear_method.dequantize(qkv), deq.get_submodule("model.layers.1.self_attn.qkv_proj").weight)
    gate_up = native.get_submodule("model.layers.2.mlp.gate_up_proj")
    assert isinstance(gate_up.linear_method, UnquantizedLinearMethod)
    assert torch.equal(gate_up.weight, deq.get_submodule("model.layers.2.mlp.gate_up_proj").weight)
    assert isinstance(native.get_submodule("model.layers.2.mlp.down_proj").linear_method, GGUFLinearMethod)
    be = make_backend("cpu" if "cpu" in available_backends() else available_backends()[0])
    prompts = random_prompts([5, 40], files.hf_config.vocab_size, seed=2)
    for a, b in zip(paged_prompt_logprobs(native, be, prompts, 16), paged_prompt_logprobs(deq, be, prompts, 16)):
        assert (a - b).abs().max().item() < 1e-4


def test_gguf_quantization_needs_a_gguf_file(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        build_model(open_model(tiny_llama_dir), "float32", quantization="gguf")
    with pytest.raises(ValueError, match="lists no GGUF layer types"):
        GGUFConfig.from_config({"quant_method": "gguf"})
    with pytest.raises(ValueError, match=r"'Q5_K' is not supported natively; supported: "
                                         r"\['Q4_0', 'Q4_1', 'Q8_0', 'Q4_K', 'Q6_K'\]"):
        GGUFConfig({"model.layers.0.mlp.down_proj": "Q5_K"})


# ---- the default model (SmolLM2-135M-Instruct, Q4_1 linears, Q8_0 tied embedding) -------------------
@pytest.mark.slow
def test_default_model_native_matches_dequantized():
    """Greedy 24 tokens x 3 chat prompts, float32: native Q4_1 == the dequantized path."""
    files = open_model(None)
    tok = files.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"])
               for m in ("What is the capital of France?", "Write a haiku about the sea.", "List three colors.")]
    be = make_backend("cpu" if "cpu" in available_backends() else available_backends()[0])
    native = build_model(files, "float32", quantization="gguf")
    assert isinstance(native.model.layers[0].self_attn.qkv_proj.linear_method, GGUFLinearMethod)
    ours = paged_greedy(native, be, prompts, 24, 16)
    del native
    assert ours == paged_greedy(build_model(files, "float32"), be, prompts, 24, 16)
