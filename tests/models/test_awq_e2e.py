"""Session 20's end-to-end tuning of an AWQ checkpoint's float parameters (`awq_e2e.py`, `pagellm quantize
--e2e-steps N`): the frozen-code linear against a plain-autograd reference on odd sizes, the KL on the training
windows falling, the integers untouched, the tuned directory in LLM(dir) against HF transformers with its
dequantized weights, the command equal to the stage run on its untuned checkpoint, bad options refused."""

from __future__ import annotations

import copy

import pytest
import torch

from pagellm.quantization.awq_calibrate import AWQCalibrationConfig, calibrate_model, load_float_model
from pagellm.quantization.awq_e2e import (
    E2EConfig, FrozenCodeLinear, build_student, e2e_tune, evaluate, tuned_tensors,
)
from pagellm.quantization.awq_format import dequantize_awq, quantize_awq
from pagellm.quantization.calibration_data import calibration_samples, validation_samples

G = 32


@pytest.mark.parametrize("out_features, in_features, group, lead", [(40, 96, 32, (3,)), (8, 64, 64, (2, 5)),
                                                                   (24, 160, 32, (7,))])
def test_frozen_code_linear_matches_a_plain_autograd_reference(out_features, in_features, group, lead):
    """Output, input gradient and scale gradient of FrozenCodeLinear equal those of F.linear on the weight
    dequantized in differentiable torch, (q - z) * s0 * (1 + d), on random inputs of odd sizes."""
    torch.manual_seed(out_features + in_features)
    packed = quantize_awq(torch.randn(out_features, in_features), group)
    bias = torch.randn(out_features)
    module = FrozenCodeLinear(*packed, group, bias=bias)
    with torch.no_grad():
        module.delta.normal_(0, 0.05)
    x = torch.randn(*lead, in_features, requires_grad=True)
    g = torch.randn(*lead, out_features)
    (module(x) * g).sum().backward()

    delta = module.delta.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    codes = (dequantize_awq(*packed, group) / packed[2].float().t().repeat_interleave(group, 1)).round()
    w = codes * (packed[2].float().t() * (1 + delta)).repeat_interleave(group, 1)
    y = torch.nn.functional.linear(x_ref, w, bias)
    (y * g).sum().backward()
    assert torch.allclose(module(x), y, atol=1e-5, rtol=1e-5)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    assert torch.allclose(module.delta.grad, delta.grad, atol=1e-4, rtol=1e-4)
    # at d = 0 the module is the checkpoint's dequantized weight exactly
    with torch.no_grad():
        module.delta.zero_()
        assert torch.equal(module(x), torch.nn.functional.linear(x, dequantize_awq(*packed, group), bias))


def _calibrated(tiny_llama_dir, tokenizer, seed=0):
    model = load_float_model(str(tiny_llama_dir))
    samples = calibration_samples(tokenizer, 4, 32, seed=seed)
    tensors = calibrate_model(copy.deepcopy(model), samples, AWQCalibrationConfig(group_size=G))
    return model, tensors, samples


@pytest.mark.parametrize("train_norms", [False, True])
def test_tuning_lowers_the_training_kl_and_keeps_the_integers(tiny_llama_dir, tiny_tokenizer, train_norms):
    """With the training windows as validation windows the kept step's KL is below the untuned one's, the
    returned tensors reproduce it (within the fp16 rounding of the stored scales), the integers are the same
    tensors, every scale (and with train_norms every layer norm) moved, nothing else did."""
    model, tensors, samples = _calibrated(tiny_llama_dir, tiny_tokenizer)
    config = E2EConfig(12, lr=3e-3, batch_size=2, eval_every=3, patience=10, train_norms=train_norms)
    tuned, report = e2e_tune(model, tensors, G, samples, samples, config)
    ids = torch.tensor(samples)
    untuned_kl, _ = evaluate(model, build_student(model, tensors, G)[0], ids, 4)
    tuned_kl, _ = evaluate(model, build_student(model, tuned, G)[0], ids, 4)
    assert report["val"][0][1] == pytest.approx(untuned_kl, rel=1e-5)
    assert report["best_step"] > 0 and tuned_kl < 0.9 * untuned_kl
    # the scales are stored in fp16 (AutoAWQ's format): the written tensors are the trained state within that rounding
    assert tuned_kl == pytest.approx(min(kl for _, kl, _ in report["val"]), rel=3e-3)
    assert len(report["train_kl"]) == report["stopped_at"] == 12
    assert tuned.keys() == tensors.keys()
    for name, t in tensors.items():
        moved = not torch.equal(tuned[name], t)
        norm = name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))
        assert moved == (name.endswith(".scales") or (train_norms and norm)), name
        assert tuned[name].dtype == t.dtype and tuned[name].shape == t.shape
        if name.endswith((".qweight", ".qzeros")):
            assert tuned[name] is t


def test_early_stopping_keeps_the_best_validation_step(tiny_llama_dir, tiny_tokenizer):
    """A learning rate far too high: validation KL rises, patience stops the run, the untuned tensors come back."""
    model, tensors, samples = _calibrated(tiny_llama_dir, tiny_tokenizer)
    val = validation_samples(tiny_tokenizer, 3, 32, exclude=[], seed=7)
    tuned, report = e2e_tune(model, tensors, G, samples, val, E2EConfig(40, lr=0.5, eval_every=2, patience=2))
    kls = [kl for _, kl, _ in report["val"]]
    assert report["stopped_at"] < 40 and report["best_step"] == min(report["val"], key=lambda v: v[1])[0]
    if report["best_step"] == 0:
        assert all(torch.equal(tuned[n], tensors[n]) for n in tensors)
    assert kls[0] >= min(kls)


def test_quantize_with_e2e_loads_like_hf_and_equals_the_stage_on_its_checkpoint(tmp_path, tiny_llama_dir,
                                                                                 tiny_tokenizer):
    """quantize_model_awq(e2e_steps=...) writes the untuned calibration's integers with tuned scales; LLM(dir)
    scores a prompt as HF does with its dequantized weights; running the stage on the untuned directory's tensors
    (bench_awq_e2e.py's way) gives the same tensors bit for bit."""
    from safetensors.torch import load_file
    from test_awq_calibrate import _assert_prompt_logprobs_match_hf

    from pagellm.entrypoints.quantize import e2e_stage, quantize_model_awq
    from pagellm.quantization.calibration_data import calibration_windows

    common = dict(group_size=G, num_samples=4, seq_len=32, dtype="float32", seed=2, validation_samples=3)
    messages = []
    out = quantize_model_awq(str(tiny_llama_dir), tmp_path / "e2e", e2e_steps=6, e2e_lr=3e-3, e2e_batch_size=2,
                             e2e_norms=True, progress=messages.append, **common)
    assert any(m.startswith("e2e: kept step") for m in messages), messages
    plain = quantize_model_awq(str(tiny_llama_dir), tmp_path / "plain", **common)
    got, untuned = load_file(str(out / "model.safetensors")), load_file(str(plain / "model.safetensors"))
    assert got.keys() == untuned.keys()
    assert all(torch.equal(got[n], untuned[n]) for n in got if n.endswith((".qweight", ".qzeros")))
    _assert_prompt_logprobs_match_hf(out, tiny_llama_dir, tiny_tokenizer, max_tokens=1)

    windows = calibration_windows(tiny_tokenizer, 4, 32, 2)
    config = E2EConfig(6, lr=3e-3, batch_size=2, train_norms=True, seed=2)
    again = e2e_stage(str(tiny_llama_dir), tiny_tokenizer, untuned, windows, G, config, 3, 2, lambda _m: None)
    assert all(torch.equal(again[n], got[n]) for n in got)


@pytest.mark.parametrize("bad, error, match", [
    (dict(e2e_steps=-1), ValueError, "e2e_steps"), (dict(e2e_steps=1.5), ValueError, "e2e_steps"),
    (dict(e2e_steps=2, e2e_lr=0.0), ValueError, "lr"), (dict(e2e_steps=2, e2e_lr=1.5), ValueError, "lr"),
    (dict(e2e_steps=2, e2e_batch_size=0), ValueError, "batch_size"),
    (dict(e2e_steps=2, e2e_batch_size=2.0), TypeError, "batch_size")])
def test_quantize_refuses_bad_e2e_options_before_work(tmp_path, tiny_llama_dir, bad, error, match):
    from pagellm.entrypoints.quantize import quantize_model_awq

    with pytest.raises(error, match=match):
        quantize_model_awq(str(tiny_llama_dir), tmp_path / "out", **bad)
    assert not (tmp_path / "out").exists()


def test_tuning_refuses_a_checkpoint_without_awq_tensors(tiny_llama_dir, tiny_tokenizer):
    model, tensors, samples = _calibrated(tiny_llama_dir, tiny_tokenizer)
    broken = {n: t for n, t in tensors.items() if not n.startswith("model.layers.1.mlp.up_proj")}
    with pytest.raises(ValueError, match="up_proj"):
        e2e_tune(model, broken, G, samples, samples, E2EConfig(1))
    with pytest.raises(ValueError, match="samples"):
        e2e_tune(model, tensors, G, samples, [], E2EConfig(1))
    assert tuned_tensors(build_student(model, tensors, G)[0], tensors, False).keys() == tensors.keys()


def test_cli_takes_the_e2e_options(tmp_path, tiny_llama_dir, capsys):
    from pagellm.entrypoints.cli import main

    out = tmp_path / "cli"
    assert main(["quantize", "--method", "awq", "--model", str(tiny_llama_dir), "--output", str(out),
                 "--group-size", "32", "--num-samples", "2", "--seq-len", "16", "--rounding", "rtn",
                 "--no-group-search", "--refine-sweeps", "0", "--e2e-steps", "2", "--e2e-lr", "1e-3",
                 "--e2e-batch-size", "1", "--e2e-norms", "--validation-samples", "2"]) == 0
    printed = capsys.readouterr().out
    assert "then 2 E2E steps (lr 0.001, 1 windows each, norms too)" in printed and "[awq] e2e: kept step" in printed
    assert (out / "model.safetensors").is_file()
