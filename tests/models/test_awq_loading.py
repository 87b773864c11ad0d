"""Loading AutoAWQ checkpoints (quantization="awq") on tiny random Llama / Qwen2 models.

Each case writes an AutoAWQ-format directory (awq_checkpoints.write_awq_dir: qweight / qzeros / scales per
decoder linear, config.json's quantization_config) and compares pagellm, model dtype float32, with
transformers float32 running the dequantized weights (`dequantize_awq`, the same integers and scales):
prompt logprobs and the logprobs of every greedy decode step within 1e-4, greedy tokens equal (measured:
2e-6 with the compiled op and with the reference; both sides compute x @ ((q - z) * s)^T in float32 and
differ only in summation order).

transformers' own AWQ path (transformers 5 delegates to gptqmodel) is not exercised here: gptqmodel 7.7
installs without compiling, but its first AWQ forward on CPU JIT-compiles a C++ extension, which ran for
more than six minutes on the test machine; the dequantized float model is the comparison instead.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers as tf

from awq_checkpoints import (
    awq_quantization_config, is_awq_linear, rewrite_tensors, set_quantization_config, write_awq_dir,
)
from paged_model_utils import (
    available_backends, hf_greedy_batch, hf_prompt_logprobs, make_backend, make_tiny_hf, paged_greedy,
    paged_prompt_logprobs, random_prompts,
)
from pagellm.layers import Linear
from pagellm.model_loader import build_model, open_model
from pagellm.models.llama import LlamaForCausalLM
from pagellm.ops import ops_available, reference
from pagellm.quantization import AWQConfig, AWQLinearMethod, UnquantizedLinearMethod
from pagellm.quantization.awq_format import awq_to_kernel_layout
from safetensors.torch import load_file

LOGPROB_TOL = 1e-4
NEW_TOKENS = 12
LENGTHS = [1, 9, 40]

# name -> (HF config class, model class, config overrides, group_size, modules_to_not_convert)
CASES = {
    "llama_g32": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(head_dim=16), 32, None),
    "qwen2_bias_g64": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(num_hidden_layers=3), 64, None),
    "llama_whole_input_group": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(head_dim=16), -1, None),
    # down_proj everywhere and layer 1's merged gate/up stay float
    "qwen2_not_converted": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(), 32, ["down_proj", "layers.1.mlp"]),
}


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("awq")


@functools.lru_cache(maxsize=None)
def _case(name: str, tmp_root: Path):
    """(checkpoint dir, dequantized HF model, the float HF model it came from)."""
    cfg_cls, model_cls, overrides, group, skip = CASES[name]
    hf = make_tiny_hf(cfg_cls, model_cls, seed=len(name), **overrides)
    path, dequantized = write_awq_dir(hf, tmp_root / name, group, skip)
    return path, dequantized, hf


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _linears(model) -> dict[str, Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


# ---- parity with transformers ------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers_on_the_dequantized_weights(name, tmp_root):
    path, dequantized, hf = _case(name, tmp_root)
    model = build_model(open_model(path), dtype="float32")
    backend = make_backend(available_backends()[0])
    prompts = random_prompts(LENGTHS, hf.config.vocab_size, seed=len(name))
    for prompt, got in zip(prompts, paged_prompt_logprobs(model, backend, prompts, 16)):
        want = hf_prompt_logprobs(dequantized, prompt)
        assert (got - want).abs().max().item() < LOGPROB_TOL, f"{name}: prompt of {len(prompt)} tokens"
        # the quantization is real: the float model is far from the dequantized one
        assert (hf_prompt_logprobs(hf, prompt) - want).abs().max().item() > 100 * LOGPROB_TOL
    tokens, step_logprobs = paged_greedy(model, backend, prompts, NEW_TOKENS, 16, return_logprobs=True)
    assert tokens == hf_greedy_batch(dequantized, prompts, NEW_TOKENS), name
    for prompt, gen, steps in zip(prompts, tokens, step_logprobs):
        full = hf_prompt_logprobs(dequantized, prompt + gen)
        for j, lp in enumerate(steps):
            assert (lp - full[len(prompt) - 1 + j]).abs().max().item() < LOGPROB_TOL, f"{name}: decode step {j}"


def test_default_op_is_compiled_and_agrees_with_the_reference(tmp_root):
    """The layers use torch.ops.pagellm.awq_linear when _C has a CPU kernel (else the reference); swapping in
    the pure-torch reference gives logits within 1e-5 and the same greedy tokens."""
    path, _, hf = _case("llama_g32", tmp_root)
    model = build_model(open_model(path), dtype="float32")
    compiled = ops_available()[0] and hasattr(torch.ops.pagellm, "awq_linear")
    want_op = torch.ops.pagellm.awq_linear.default if compiled else reference.awq_linear
    awq_layers = [m for m in _linears(model).values() if isinstance(m.linear_method, AWQLinearMethod)]
    assert len(awq_layers) == 2 * 4 and all(m.linear_method.op is want_op for m in awq_layers)
    backend = make_backend(available_backends()[0])
    prompts = random_prompts(LENGTHS, hf.config.vocab_size, seed=11)
    default_lps = paged_prompt_logprobs(model, backend, prompts, 16)
    default_tokens = paged_greedy(model, backend, prompts, NEW_TOKENS, 16)
    for layer in awq_layers:
        layer.linear_method.op = reference.awq_linear
    for a, b in zip(default_lps, paged_prompt_logprobs(model, backend, prompts, 16)):
        assert (a - b).abs().max().item() < 1e-5
    assert paged_greedy(model, backend, prompts, NEW_TOKENS, 16) == default_tokens


@pytest.mark.parametrize("dtype, tol", [("bfloat16", 0.15), ("float16", 0.03)])
def test_half_precision_model_dtype_stays_close(dtype, tol, tmp_root):
    """AWQ checkpoints usually run in fp16 / bf16 activations: prompt logprobs against transformers float32 on
    the dequantized weights (measured: 0.03 in bf16, 0.005 in fp16; the weights are the same, the activations
    round)."""
    path, dequantized, hf = _case("qwen2_bias_g64", tmp_root)
    model = build_model(open_model(path), dtype=dtype)
    assert model.model.layers[0].self_attn.qkv_proj.bias.dtype == getattr(torch, dtype)
    prompts = random_prompts(LENGTHS[1:], hf.config.vocab_size, seed=2)
    for prompt, got in zip(prompts, paged_prompt_logprobs(model, make_backend(available_backends()[0]), prompts, 16)):
        assert (got - hf_prompt_logprobs(dequantized, prompt)).abs().max().item() < tol


def test_llm_generate_with_the_flag_and_from_the_checkpoint(tmp_root):
    """LLM(path) and LLM(path, quantization="awq") give transformers' greedy tokens on the dequantized model."""
    from pagellm import LLM, SamplingParams  # noqa: PLC0415

    path, dequantized, hf = _case("qwen2_bias_g64", tmp_root)
    prompts = random_prompts([5, 23], hf.config.vocab_size, seed=3)
    want = hf_greedy_batch(dequantized, prompts, NEW_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    for kwargs in ({}, {"quantization": "awq"}):
        llm = LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=32, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, kwargs


def test_cli_passes_the_quantization_flag():
    from pagellm.entrypoints.cli import _engine_kwargs, build_parser  # noqa: PLC0415
    from pagellm.entrypoints.serve import add_serve_args, engine_kwargs  # noqa: PLC0415

    args = build_parser().parse_args(["generate", "hello", "--model", "m", "--quantization", "awq"])
    assert _engine_kwargs(args)["quantization"] == "awq"
    import argparse  # noqa: PLC0415

    serve = add_serve_args(argparse.ArgumentParser()).parse_args(["m", "--quantization", "awq"])
    assert engine_kwargs(serve)["quantization"] == "awq"


# ---- what gets loaded ------------------------------------------------------------------------------
def test_merged_layers_hold_the_checkpoint_shards_in_the_kernel_layout(tmp_root):
    path, _, _ = _case("qwen2_bias_g64", tmp_root)
    model = build_model(open_model(path), dtype="float32")
    sd = load_file(path / "model.safetensors")
    for merged, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                          ("mlp.gate_up_proj", ("gate_proj", "up_proj"))):
        layer = model.get_submodule(f"model.layers.2.{merged}")
        prefix = f"model.layers.2.{merged.split('.')[0]}"
        merged_tensors = [torch.cat([sd[f"{prefix}.{p}.{leaf}"] for p in parts], dim=1)
                          for leaf in ("qweight", "qzeros", "scales")]
        qweight, scales, zeros = awq_to_kernel_layout(*merged_tensors, 64)
        assert isinstance(layer.linear_method, AWQLinearMethod) and not hasattr(layer, "qzeros")
        assert torch.equal(layer.qweight, qweight) and torch.equal(layer.zeros, zeros)
        assert torch.equal(layer.scales, scales) and layer.scales.dtype == torch.float32
    qkv = model.model.layers[2].self_attn.qkv_proj
    want_bias = torch.cat([sd[f"model.layers.2.self_attn.{p}.bias"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.bias, want_bias)  # Qwen2's qkv bias stays float
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32


def test_modules_to_not_convert_stay_float(tmp_root):
    path, dequantized, _ = _case("qwen2_not_converted", tmp_root)
    model = build_model(open_model(path), dtype="float32")
    skip = CASES["qwen2_not_converted"][4]
    for name, layer in _linears(model).items():
        float_layer = name.endswith("down_proj") or name == "model.layers.1.mlp.gate_up_proj"
        method = UnquantizedLinearMethod if float_layer else AWQLinearMethod
        assert type(layer.linear_method) is method, name
    down = model.model.layers[0].mlp.down_proj
    assert torch.equal(down.weight, dequantized.model.layers[0].mlp.down_proj.weight)  # untouched float weight
    assert not is_awq_linear("model.layers.1.mlp.up_proj.weight", skip)


def test_quant_config_json_next_to_config_json(tmp_root):
    """AutoAWQ's older export: quant_config.json (w_bit, q_group_size, version "GEMM"), no quantization_config."""
    original = _case("llama_g32", tmp_root)[0]
    path = _copy(original, tmp_root / "quant_config_json")
    set_quantization_config(path, None)
    (path / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 32, "w_bit": 4,
                                                       "version": "GEMM"}))
    from_config_json = _linears(build_model(open_model(original), dtype="float32"))
    for quantization in (None, "awq"):
        model = build_model(open_model(path), dtype="float32", quantization=quantization)
        for (name, a), b in zip(_linears(model).items(), from_config_json.values()):
            assert isinstance(a.linear_method, AWQLinearMethod) and torch.equal(a.qweight, b.qweight), name
            assert torch.equal(a.scales, b.scales) and torch.equal(a.zeros, b.zeros), name


# ---- bad input: ValueError, and no model built ------------------------------------------------------
@pytest.fixture
def no_model_built(monkeypatch):
    """Fail the test if a Llama/Qwen2 model is constructed (the refusal must come first)."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("the model was built before the checkpoint was refused")

    monkeypatch.setattr(LlamaForCausalLM, "__init__", refuse)


@pytest.mark.parametrize("changes, message", [
    ({"bits": 8}, r"bits=8 is not supported; supported: \[4\]"),
    ({"group_size": 48}, r"group_size=48 is not supported; supported: a positive multiple of 32"),
    ({"group_size": 16}, r"group_size=16 is not supported"),
    ({"version": "gemv"}, r"version 'gemv' is not supported.*supported: \['gemm'\]"),
    ({"zero_point": False}, r"zero_point=False .*not supported; supported: zero_point=True"),
    ({"w_bit": 3}, r"bits=4 and w_bit=3 disagree"),
    ({"modules_to_not_convert": "lm_head"}, r"modules_to_not_convert must be a list"),
])
def test_unsupported_quantization_config_is_refused(changes, message, tmp_root, tmp_path, no_model_built):
    with pytest.raises(ValueError, match=message):
        AWQConfig.from_config({**awq_quantization_config(32), **changes})
    path = _copy(_case("llama_g32", tmp_root)[0], tmp_path / "model")
    set_quantization_config(path, {**awq_quantization_config(32), **changes})
    with pytest.raises(ValueError, match=message):
        build_model(open_model(path), dtype="float32")


def test_tensors_disagreeing_with_the_config_are_refused(tmp_root, tmp_path, no_model_built):
    hf = make_tiny_hf(tf.LlamaConfig, tf.LlamaForCausalLM, seed=5, head_dim=16)
    # quantized with groups of 32, config says 64: scales / qzeros have twice the rows the config implies
    path, _ = write_awq_dir(hf, tmp_path / "group_mismatch", 64, quantize_group_size=32)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.down_proj\.qzeros': expected I32 \[2, 8\] "
                                         r"for qweight \[128, 8\] with group_size=64, got I32 \[4, 8\]"):
        build_model(open_model(path), dtype="float32")

    path, _ = write_awq_dir(hf, tmp_path / "float_qweight", 32)
    rewrite_tensors(path, lambda t: t.update({"model.layers.1.self_attn.o_proj.qweight":
                                              t["model.layers.1.self_attn.o_proj.qweight"].float()}))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.o_proj\.qweight': expected a 2-D int32"):
        build_model(open_model(path), dtype="float32")

    rewrite_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.scales"))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.scales' is missing"):
        build_model(open_model(path), dtype="float32", quantization="awq")


def test_awq_on_an_unquantized_checkpoint_is_refused(tmp_root, no_model_built):
    _, _, hf = _case("llama_g32", tmp_root)
    path = tmp_root / "float_llama"
    if not path.exists():
        hf.save_pretrained(path)
    with pytest.raises(ValueError, match=r"not AWQ-quantized; run `pagellm quantize --method awq --model MODEL --output OUT` first"):
        build_model(open_model(path), quantization="awq")
    # config says awq but the tensors are float
    fake = _copy(path, tmp_root / "float_llama_says_awq")
    set_quantization_config(fake, awq_quantization_config(32))
    with pytest.raises(ValueError, match=r"holds no AWQ tensors.*pagellm quantize --method awq"):
        build_model(open_model(fake))


def test_other_methods_on_an_awq_checkpoint_are_refused(tmp_root, no_model_built):
    path, _, _ = _case("llama_g32", tmp_root)
    for method in ("int8", "gguf"):
        with pytest.raises(ValueError, match=r"already quantized with quant_method='awq'|not a \.gguf file"):
            build_model(open_model(path), quantization=method)


def test_layer_shapes_the_layout_cannot_hold_are_refused():
    from pagellm.layers.linear import MergedLinear  # noqa: PLC0415

    config = AWQConfig(group_size=32)
    with pytest.raises(ValueError, match=r"packs 8 output features per int32, but its output shards have sizes "
                                         r"\[16, 4\]"):
        MergedLinear(64, [16, 4], quant_config=config, prefix="model.layers.0.mlp.gate_up_proj")
    with pytest.raises(ValueError, match=r"in_features=48 is not a multiple of the AWQ group_size 32"):
        Linear(48, 16, quant_config=config, prefix="model.layers.0.self_attn.o_proj")
    mixed = AWQConfig(group_size=32, modules_to_not_convert=["self_attn.q_proj"])
    with pytest.raises(ValueError, match=r"keeps \['model\.layers\.0\.self_attn\.q_proj'\] float but not the rest"):
        MergedLinear(64, [16, 8, 8], quant_config=mixed, prefix="model.layers.0.self_attn.qkv_proj",
                     shard_ids=["q", "k", "v"])
