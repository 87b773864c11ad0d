"""`pagellm quantize --method awq`: AWQ's searches against direct computations, AWQ against plain RTN on a
model with large-magnitude input channels, the written AutoAWQ directory against the float model, the CLI."""

from __future__ import annotations

import copy
import json
import subprocess

import pytest
import torch

from pagellm.quantization.awq_calibrate import (
    CAPTURED_INPUTS, LAYER_LINEARS, AWQCalibrationConfig, LayerRunner, calibrate_layer, choose_group_size,
    fold_scales, load_float_model, scaling_groups,
)
from pagellm.quantization.awq_format import dequantize_awq, quantize_awq
from pagellm.quantization.awq_search import (
    InputStats, activation_scales, group_output_errors, pseudo_quantize, scaled_quantization_error,
)
from pagellm.quantization.calibration_data import (
    HELD_OUT_KJV_BOOKS, calibration_samples, kjv_documents, parse_bible_output,
)

OUTLIER_CHANNELS = (3, 17, 40, 101)


def _outlier_llama(tmp_path, tokenizer, num_kv_heads: int = 4, weight_std: float = 0.08, family: str = "llama"):
    """A tiny random Llama (or Qwen2: q/k/v biases) with hidden 128, MHA by default so v -> o is scaled too,
    whose norms blow a few input channels up 30x: the activation outliers AWQ is about. Written to
    tmp_path/"float" and returned."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    path = tmp_path / "float"
    cfg_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    cfg = cfg_cls(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=256,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith("proj.bias"):  # matrices, Qwen2's q/k/v biases
                p.normal_(0.0, weight_std)
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[list(OUTLIER_CHANNELS)] *= 30.0
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_token_id]}))
    return path, load_float_model(str(path))


def _random_ids(vocab: int, num: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (num, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------- the searches
def test_pseudo_quantize_is_quantize_awq_round_trip():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pseudo_quantize(w, 32), dequantize_awq(*quantize_awq(w, 32), 32).t().contiguous().t())


def test_gram_errors_equal_the_direct_computation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=g) * torch.linspace(0.1, 5.0, 64)
    weights = [torch.randn(24, 64, generator=g), torch.randn(16, 64, generator=g)]
    stats = InputStats.empty(64)
    stats.add(x[:100])
    stats.add(x[100:])
    s = activation_scales(x.abs().mean(0), 0.5)
    direct = torch.cat([(x / s) @ pseudo_quantize(w * s, 32).t() - x @ w.t() for w in weights], 1).pow(2).mean()
    assert scaled_quantization_error(stats, weights, s, 32) == pytest.approx(direct.item(), rel=1e-4)
    err = pseudo_quantize(weights[0], 32) - weights[0]  # per (row, group): sum_t (x_g . e_g)^2
    per_group = torch.stack([(x[:, k:k + 32] @ err[:, k:k + 32].t()).pow(2).sum(0) for k in (0, 32)], 1)
    torch.testing.assert_close(group_output_errors(stats, err, 32), per_group, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_folding_keeps_the_float_layer(tmp_path, tiny_tokenizer, family):
    _, model = _outlier_llama(tmp_path, tiny_tokenizer, family=family)
    assert (model.model.layers[0].self_attn.v_proj.bias is not None) == (family == "qwen2")
    layer = model.model.layers[0]
    runner = LayerRunner(model.model.rotary_emb, 16, 4)
    hidden = model.model.embed_tokens(_random_ids(len(tiny_tokenizer), 4, 16, 0)).detach()
    with torch.no_grad():
        before, stats = runner.forward(layer, hidden, CAPTURED_INPUTS)
        groups = scaling_groups(layer)
        assert [g.prev for g in groups] == ["input_layernorm", "self_attn.v_proj", "post_attention_layernorm",
                                            "mlp.up_proj"]
        for group in groups:
            s = torch.rand(layer.get_submodule(group.linears[0]).in_features) + 0.5
            fold_scales(layer, group, s, stats)
        after, refreshed = runner.forward(layer, hidden, CAPTURED_INPUTS)
    assert ((after - before).norm() / before.norm()).item() < 1e-5  # float32 rounding only
    for name in CAPTURED_INPUTS:  # the folded stats are those of the folded layer's inputs
        want = refreshed[name].gram
        assert ((stats[name].gram - want).norm() / want.norm()).item() < 1e-5
        assert ((stats[name].abs_sum - refreshed[name].abs_sum).norm() / refreshed[name].abs_sum.norm()) < 1e-5


def test_gqa_layer_skips_v_to_o(tmp_path, tiny_tokenizer):
    _, model = _outlier_llama(tmp_path, tiny_tokenizer, num_kv_heads=2)
    assert "self_attn.v_proj" not in [g.prev for g in scaling_groups(model.model.layers[0])]


# ------------------------------------------------------------------------------------------- AWQ vs RTN
@pytest.mark.parametrize("clip", [False, True])
def test_awq_beats_round_to_nearest_on_outlier_channels(tmp_path, tiny_tokenizer, clip):
    """Calibrated on some token ids, scored on others: the layer's output error with AWQ's searched scales
    (and clipping) is well below that of plain RTN `quantize_awq` of the same float weights."""
    _, model = _outlier_llama(tmp_path, tiny_tokenizer)
    runner = LayerRunner(model.model.rotary_emb, 32, 4)
    embed = model.model.embed_tokens
    with torch.no_grad():
        calib = embed(_random_ids(len(tiny_tokenizer), 8, 32, 0))
        held_out = embed(_random_ids(len(tiny_tokenizer), 8, 32, 1))
        layer = model.model.layers[0]
        reference = runner.forward(layer, held_out)[0]
        rtn = copy.deepcopy(layer)
        for name in LAYER_LINEARS:
            lin = rtn.get_submodule(name)
            lin.weight.copy_(dequantize_awq(*quantize_awq(lin.weight, 32), 32))
        awq = copy.deepcopy(layer)
        _, stats = runner.forward(awq, calib, CAPTURED_INPUTS)
        _, losses = calibrate_layer(awq, stats, AWQCalibrationConfig(group_size=32, clip=clip))
        rtn_err = (runner.forward(rtn, held_out)[0] - reference).pow(2).mean().item()
        awq_err = (runner.forward(awq, held_out)[0] - reference).pow(2).mean().item()
    assert min(losses["input_layernorm"]) < 0.5 * losses["input_layernorm"][0]  # the search found real gains
    assert awq_err < 0.5 * rtn_err, (awq_err, rtn_err)


# ------------------------------------------------------------------------------------------- the directory
def _dequantized_state_dict(out_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    stored = load_file(str(out_dir / "model.safetensors"))
    group = json.loads((out_dir / "config.json").read_text())["quantization_config"]["group_size"]
    state = {}
    for name, t in stored.items():
        if name.endswith(".qweight"):
            base = name.removesuffix(".qweight")
            state[base + ".weight"] = dequantize_awq(t, stored[base + ".qzeros"], stored[base + ".scales"], group)
        elif not name.endswith((".qzeros", ".scales")):
            state[name] = t.to(torch.float32)
    return state


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _relative_error(model, reference, ids) -> float:
    got, want = _logits(model, ids), _logits(reference, ids)
    return ((got - want).norm() / want.norm()).item()


def test_written_directory_round_trips(tmp_path, tiny_tokenizer):
    """The directory's tensors, dequantized (`dequantize_awq`) into an HF float32 Llama, give exactly the
    calibrated model's logits, and logits close to the float model's: relative error < 0.25 (4-bit, groups of
    32, 30x outlier channels) and under 0.6x that of plain RTN, on held-out text."""
    from pagellm.quantization.awq_calibrate import calibrate_model
    from pagellm.quantization.awq_export import write_awq_checkpoint

    src, float_model = _outlier_llama(tmp_path, tiny_tokenizer, weight_std=0.02)
    calibrated = copy.deepcopy(float_model)  # calibrated in place: what the files must reproduce
    tensors = calibrate_model(calibrated, calibration_samples(tiny_tokenizer, 8, 64, seed=0),
                              AWQCalibrationConfig(group_size=32))
    out = write_awq_checkpoint(tensors, src, tmp_path / "awq", 32, dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                          "version": "gemm", "modules_to_not_convert": ["lm_head"]}
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes()
    from safetensors.torch import load_file
    stored = load_file(str(out / "model.safetensors"))
    q = stored["model.layers.0.self_attn.q_proj.qweight"]
    assert q.dtype == torch.int32 and tuple(q.shape) == (128, 128 // 8)
    assert stored["model.layers.0.self_attn.q_proj.scales"].dtype == torch.float16
    assert not any(name.endswith("proj.weight") for name in stored)

    state = _dequantized_state_dict(out)
    awq_model = copy.deepcopy(float_model)
    awq_model.load_state_dict(state, strict=True)
    rtn_model = copy.deepcopy(float_model)
    with torch.no_grad():
        for layer in rtn_model.model.layers:
            for name in LAYER_LINEARS:
                lin = layer.get_submodule(name)
                lin.weight.copy_(dequantize_awq(*quantize_awq(lin.weight, 32), 32))
    held_out = torch.tensor(calibration_samples(tiny_tokenizer, 4, 64, seed=12345))
    assert _relative_error(awq_model, calibrated, held_out) < 1e-5
    awq_err = _relative_error(awq_model, float_model, held_out)
    rtn_err = _relative_error(rtn_model, float_model, held_out)
    assert awq_err < 0.25 and awq_err < 0.6 * rtn_err, (awq_err, rtn_err)

    # folded norms: norm[k] * W[:, k] is what the float layer computes with; AWQ moved the outliers' scale
    # from the norm into the weights, so the product survives (up to 4-bit rounding) while the norm changed
    # (v_proj / up_proj are left out: their rows are also divided by the v -> o / up -> down scales)
    orig = float_model.model.layers[0]
    outliers = list(OUTLIER_CHANNELS)
    for norm, projs in (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj")),
                        ("post_attention_layernorm", ("mlp.gate_proj",))):
        old_norm, new_norm = orig.get_submodule(norm).weight, state[f"model.layers.0.{norm}.weight"]
        ratio = new_norm / old_norm
        assert ratio[outliers].max() < 0.5 * ratio.median()  # the outlier channels' norm weights were divided most
        for proj in projs:
            want = orig.get_submodule(proj).weight * old_norm
            got = state[f"model.layers.0.{proj}.weight"] * new_norm
            assert ((got - want).norm() / want.norm()).item() < 0.1, (norm, proj)


def test_choose_group_size():
    from transformers import LlamaConfig

    smol = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    assert choose_group_size(smol, None) == 64
    assert choose_group_size(smol, 32) == 32
    with pytest.raises(ValueError, match="sizes that fit: \\[64, 32\\]"):
        choose_group_size(smol, 128)


# ------------------------------------------------------------------------------------------- text
def test_calibration_text_excludes_the_benchmark_excerpt(tiny_tokenizer):
    held_out = parse_bible_output(subprocess.run(["bible", "Ecclesiastes 1:1-12:14"], capture_output=True,
                                                 text=True, check=True).stdout)
    assert list(held_out) == list(HELD_OUT_KJV_BOOKS)
    verses = [v for v in held_out["Ecclesiastes"].splitlines() if len(v) > 80]
    docs = kjv_documents()
    assert len(docs) == 65 and len(verses) > 50
    assert not any(v in doc for v in verses for doc in docs)
    a = calibration_samples(tiny_tokenizer, 6, 40, seed=3)
    assert a == calibration_samples(tiny_tokenizer, 6, 40, seed=3) != calibration_samples(tiny_tokenizer, 6, 40, seed=4)
    assert all(len(s) == 40 and s[0] == tiny_tokenizer.bos_token_id for s in a)


# ------------------------------------------------------------------------------------------- CLI
def test_cli_refuses_bad_input(tmp_path, tiny_llama_dir, capsys):
    from pagellm.entrypoints.cli import main

    assert main(["quantize", "--method", "gptq", "--output", str(tmp_path / "o")]) == 2
    assert "methods: awq" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    assert main(["quantize", "--method", "awq", "--model", str(tiny_llama_dir), "--output", str(busy)]) == 2
    assert "--overwrite" in capsys.readouterr().err and (busy / "keep.txt").read_text() == "x"
    assert main(["quantize", "--method", "awq", "--model", str(tiny_llama_dir), "--output", str(tiny_llama_dir),
                 "--overwrite"]) == 2
    assert "the model's own directory" in capsys.readouterr().err
    for bad in (["--group-size", "48"], ["--dtype", "int8"], ["--num-samples", "0"]):
        argv = ["quantize", "--method", "awq", "--model", str(tiny_llama_dir), "--output", str(tmp_path / "n"), *bad]
        assert main(argv) == 2
        assert "error:" in capsys.readouterr().err and not (tmp_path / "n").exists()


# ------------------------------------------------------------------------------------------- pagellm loads it
def _assert_prompt_logprobs_match_hf(out, tiny_llama_dir, tiny_tokenizer, max_tokens):
    """LLM(out) scores a prompt as HF transformers does with out's dequantized weights (fp32, log-probs within
    1e-3); returns (the RequestOutput of max_tokens greedy tokens, the HF reference model, the prompt ids)."""
    from pagellm import LLM, SamplingParams
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    reference.load_state_dict(_dequantized_state_dict(out), strict=True)
    prompt = tiny_tokenizer("Tell me about the sea. Once upon a time", add_special_tokens=False)["input_ids"]
    llm = LLM(str(out), dtype="float32", max_model_len=128, kv_cache_memory_gb=0.05, seed=0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=0)
    result = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([prompt])).logits[0], dim=-1)
    for pos in range(1, len(prompt)):
        want = logprobs[pos - 1, prompt[pos]].item()
        assert result.prompt_logprobs[pos][prompt[pos]].logprob == pytest.approx(want, abs=1e-3)
    return result, reference, prompt


def test_quantized_directory_loads_in_pagellm_and_generates(tmp_path, tiny_llama_dir, tiny_tokenizer):
    """LLM(dir) (quantization_config says awq) scores a prompt as HF transformers does with the directory's
    dequantized weights (fp32, log-probs within 1e-3), and generates greedily the same tokens."""
    from pagellm.entrypoints.quantize import quantize_model_awq

    out = quantize_model_awq(str(tiny_llama_dir), tmp_path / "awq", group_size=32, num_samples=4, seq_len=32,
                             dtype="float32")
    result, reference, prompt = _assert_prompt_logprobs_match_hf(out, tiny_llama_dir, tiny_tokenizer, max_tokens=6)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, reference(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert list(result.outputs[0].token_ids) == ids[0, len(prompt):].tolist()


def test_overwrite_removes_the_old_checkpoint_files(tmp_path, tiny_llama_dir):
    from pagellm.quantization.awq_export import check_output_dir, write_awq_checkpoint

    out = tmp_path / "out"
    out.mkdir()
    for stale in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "quant_config.json"):
        (out / stale).write_text("{}")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="--overwrite"):
        check_output_dir(out, overwrite=False)
    w = torch.randn(16, 32)
    write_awq_checkpoint({"model.layers.0.mlp.down_proj." + k: v for k, v in zip(
        ("qweight", "qzeros", "scales"), quantize_awq(w, 32))} | {"model.norm.weight": torch.ones(16)},
        tiny_llama_dir, check_output_dir(out, overwrite=True), 32, dtype="bfloat16")
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".safetensors", ".json") and "token" not in p.name) == [
        "config.json", "generation_config.json", "model.safetensors"]
    assert (out / "notes.txt").read_text() == "mine"
    from safetensors.torch import load_file
    stored = load_file(str(out / "model.safetensors"))
    assert stored["model.norm.weight"].dtype == torch.bfloat16
    assert stored["model.layers.0.mlp.down_proj.scales"].dtype == torch.float16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
