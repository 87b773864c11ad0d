"""Session 18's scale choice (`AWQCalibrationConfig.scale_search`, `--scale-search`): "rounding" (s = 1 or a few
low alphas judged by the configured rounding) against a float64 reference on the activations themselves, "none"
(no AWQ scaling: nothing folded), the calibrated directory against HF / LLM(dir), and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pagellm.quantization.awq_calibrate import (
    ROUNDING_SEARCH_ALPHAS, AWQCalibrationConfig, ScalingGroup, choose_scale, quantize_linear,
)
from pagellm.quantization.awq_format import dequantize_awq
from pagellm.quantization.awq_search import InputStats, activation_scales, weight_scales
from pagellm.quantization.calibration_data import calibration_samples
from test_awq_seq import G, correlated_inputs, q4_1_grid_weights


class _Group(nn.Module):
    """A norm feeding two linears: the shape `choose_scale` reads (prev op, consumers)."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.norm = nn.Module()
        self.a, self.b = (nn.Linear(w.shape[1], w.shape[0], bias=False) for w in weights)
        with torch.no_grad():
            self.a.weight.copy_(weights[0])
            self.b.weight.copy_(weights[1])


def _reference_choice(x: torch.Tensor, weights: list[torch.Tensor], config: AWQCalibrationConfig):
    """Every candidate s (1, then `activation_scales` at ROUNDING_SEARCH_ALPHAS) rounded as the calibration
    rounds it (`quantize_linear` without refinement, on the scaled inputs' statistics), its output error
    sum ||x W^T - (x / s) Q(W diag(s))^T||^2 computed on the activations in float64; the first least kept."""
    stats = InputStats.empty(x.shape[1])
    stats.add(x)
    mean_abs = x.abs().mean(dim=0)
    w_mean = weight_scales(weights, G)
    candidates = [torch.ones(x.shape[1])] + [activation_scales(mean_abs, a, w_mean) for a in ROUNDING_SEARCH_ALPHAS]
    errors = []
    for s in candidates:
        scaled = InputStats.empty(x.shape[1])
        scaled.add(x / s)
        total = 0.0
        for w, clip in zip(weights, (True, False)):
            ws = w * s
            wq = dequantize_awq(*quantize_linear(ws, scaled, config, clip), G).to(torch.float64)
            y = x.to(torch.float64) @ w.to(torch.float64).t()
            y_q = (x.to(torch.float64) / s.to(torch.float64)) @ wq.t()
            total += float(((y - y_q) ** 2).sum())
        errors.append(total)
    best = min(range(len(errors)), key=lambda i: (errors[i], i))
    return candidates[best], errors


@pytest.mark.parametrize("rounding,grid", [("gptq", True), ("rtn", False)])
def test_rounding_judged_scale_matches_the_float64_reference(rounding, grid):
    """`choose_scale(scale_search="rounding")` picks the candidate the float64 reference on the activations picks,
    and reports the same errors (s = 1's first)."""
    weights = [q4_1_grid_weights(24, 96, seed=31) if grid else torch.randn(24, 96) * 0.05,
               q4_1_grid_weights(16, 96, seed=32) if grid else torch.randn(16, 96) * 0.05]
    x = correlated_inputs(400, 96, seed=33) * torch.linspace(0.2, 4.0, 96)  # uneven channels: scales matter
    config = AWQCalibrationConfig(group_size=G, rounding=rounding, group_search=grid, scale_search="rounding")
    stats = InputStats.empty(96)
    stats.add(x)
    layer = _Group(weights)
    group = ScalingGroup("norm", ("a", "b"))
    import pagellm.quantization.awq_calibrate as cal

    no_clip = cal.NO_CLIP_LINEARS
    cal.NO_CLIP_LINEARS = ("b",)  # "b" rounds without the clip search, like q / k
    try:
        s, losses = choose_scale(layer, group, stats, config)
    finally:
        cal.NO_CLIP_LINEARS = no_clip
    want_s, want_errors = _reference_choice(x, weights, config)
    assert losses == pytest.approx(want_errors, rel=1e-4)
    assert len(set(round(e, 6) for e in want_errors)) == len(want_errors)  # the candidates differ
    if bool((want_s == 1).all()):
        assert s is None
    else:
        assert torch.equal(s, want_s)


def test_rounding_judged_scale_keeps_s_1_on_grid_weights_that_rtn_would_scale():
    """Q4_1-grid weights with mildly uneven inputs: AutoAWQ's RTN-judged grid moves off s = 1, the rounding
    that will really be used (GPTQ + group search) is best at s = 1 (the default model's case)."""
    from pagellm.quantization.awq_search import search_scale

    weights = [q4_1_grid_weights(32, 128, seed=34), q4_1_grid_weights(32, 128, seed=35)]
    x = correlated_inputs(600, 128, seed=36) * torch.linspace(0.5, 2.0, 128)
    stats = InputStats.empty(128)
    stats.add(x)
    rtn_s, _ = search_scale(stats, weights, G)
    assert not bool((rtn_s == 1).all())
    config = AWQCalibrationConfig(group_size=G, rounding="gptq", group_search=True, scale_search="rounding")
    s, losses = choose_scale(_Group(weights), ScalingGroup("norm", ("a", "b")), stats, config)
    assert s is None and losses[0] < min(losses[1:])


def test_scale_search_none_folds_nothing(tmp_path, tiny_tokenizer):
    """scale_search="none": `calibrate_layer` leaves the norms alone and rounds each linear's own weight, exactly
    as `quantize_linear` rounds it on the captured inputs."""
    from test_awq_seq import _q4_1_llama

    from pagellm.quantization.awq_calibrate import (
        CAPTURED_INPUTS, INPUT_OWNER, LAYER_LINEARS, NO_CLIP_LINEARS, LayerRunner, calibrate_layer,
    )

    _, model = _q4_1_llama(tmp_path, tiny_tokenizer)
    ids = torch.tensor(calibration_samples(tiny_tokenizer, 4, 32, seed=0))
    layer = model.model.layers[0]
    before = copy.deepcopy(layer)
    config = AWQCalibrationConfig(group_size=G, rounding="gptq", group_search=True, scale_search="none")
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids)
        _, stats = LayerRunner(model.model.rotary_emb, 32, 2).forward(layer, hidden, CAPTURED_INPUTS)
        quantized, losses = calibrate_layer(layer, dict(stats), config)
    assert all(v == [1.0] for v in losses.values())
    for norm in ("input_layernorm", "post_attention_layernorm"):
        assert torch.equal(layer.get_submodule(norm).weight, before.get_submodule(norm).weight)
    for name in LAYER_LINEARS:
        want = quantize_linear(before.get_submodule(name).weight.data, stats[INPUT_OWNER[name]], config,
                               name not in NO_CLIP_LINEARS)
        for got, expected in zip(quantized[name], want):
            assert torch.equal(got, expected), name


def test_calibrated_model_without_scaling_reproduces_hf(tmp_path, tiny_tokenizer):
    """`calibrate_model` with scale_search "none" and "rounding" on a Q4_1-grid Llama: the written directory,
    dequantized into HF transformers, gives exactly the calibrated model's logits; "none" leaves every norm
    weight as it was; "rounding" ends closer to the float model than AutoAWQ's RTN-judged scales."""
    from test_awq_seq import _calibrate_and_reload, _q4_1_llama

    src, float_model = _q4_1_llama(tmp_path, tiny_tokenizer)
    samples = calibration_samples(tiny_tokenizer, 8, 64, seed=0)
    held_out = torch.tensor(calibration_samples(tiny_tokenizer, 4, 64, seed=12345))
    errors = {}
    for scale_search in ("rtn", "rounding", "none"):
        config = AWQCalibrationConfig(group_size=G, rounding="gptq", group_search=True, scale_search=scale_search)
        calibrated, errors[scale_search] = _calibrate_and_reload(tmp_path, scale_search, src, float_model, samples,
                                                                 held_out, config)
        if scale_search == "none":
            for before, after in zip(float_model.model.layers, calibrated.model.layers):
                assert torch.equal(before.input_layernorm.weight, after.input_layernorm.weight)
                assert torch.equal(before.post_attention_layernorm.weight, after.post_attention_layernorm.weight)
    # this Llama has outlier input channels (what AWQ's scaling is for): judged by the real rounding the search
    # still scales them and beats RTN's judgement (measured 0.84x); s = 1 everywhere does not (1.23x)
    assert errors["rounding"] < 0.92 * errors["rtn"] < 0.92 * errors["none"], errors


@pytest.mark.parametrize("scale_search", ["rounding", "none"])
def test_directory_loads_in_pagellm_like_hf(tmp_path, tiny_llama_dir, tiny_tokenizer, scale_search):
    """`quantize_model_awq(scale_search=...)`: LLM(dir) scores a prompt as HF transformers does with the directory's
    dequantized weights."""
    from test_awq_calibrate import _assert_prompt_logprobs_match_hf

    from pagellm.entrypoints.quantize import quantize_model_awq

    out = quantize_model_awq(str(tiny_llama_dir), tmp_path / scale_search, group_size=G, num_samples=4, seq_len=32,
                             dtype="float32", rounding="gptq", group_search=True, scale_search=scale_search)
    _assert_prompt_logprobs_match_hf(out, tiny_llama_dir, tiny_tokenizer, max_tokens=1)


def test_bad_scale_search_is_refused(tmp_path, tiny_llama_dir, capsys):
    from pagellm.entrypoints.cli import main
    from pagellm.entrypoints.quantize import quantize_model_awq

    with pytest.raises(ValueError, match="scale_search must be one of"):
        AWQCalibrationConfig(scale_search="alpha")
    with pytest.raises(ValueError, match="scale_search 'x' not supported"):
        quantize_model_awq(str(tiny_llama_dir), tmp_path / "bad", scale_search="x")
    assert not (tmp_path / "bad").exists()
    out = tmp_path / "cli"
    assert main(["quantize", "--method", "awq", "--model", str(tiny_llama_dir), "--output", str(out),
                 "--group-size", "32", "--num-samples", "2", "--seq-len", "16", "--scale-search", "none"]) == 0
    assert "scale search none" in capsys.readouterr().out
    assert main(["quantize", "--method", "awq", "--model", str(tiny_llama_dir), "--output", str(tmp_path / "b2"),
                 "--scale-search", "bogus"]) == 2
    assert "scale_search 'bogus' not supported" in capsys.readouterr().err


def test_gptq_damp_reaches_the_rounding(tmp_path, tiny_llama_dir, capsys):
    """`--gptq-damp` / `quantize_model_awq(gptq_damp=...)` is the damping GPTQ rounds with (a different damping, a
    different checkpoint), and a damping outside (0, 1) is refused before anything is written."""
    from safetensors.torch import load_file

    from pagellm.entrypoints.cli import main
    from pagellm.entrypoints.quantize import quantize_model_awq

    with pytest.raises(ValueError, match=r"gptq_damp must be in \(0, 1\)"):
        quantize_model_awq(str(tiny_llama_dir), tmp_path / "bad", gptq_damp=1.5, rounding="gptq")
    assert not (tmp_path / "bad").exists()
    args = ["quantize", "--method", "awq", "--model", str(tiny_llama_dir), "--group-size", "32", "--num-samples", "2",
            "--seq-len", "16", "--rounding", "gptq"]
    assert main(args + ["--output", str(tmp_path / "d01"), "--gptq-damp", "0.01"]) == 0
    assert main(args + ["--output", str(tmp_path / "d30"), "--gptq-damp", "0.3"]) == 0
    assert "gptq damp 0.3" in capsys.readouterr().out
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("d01", "d30"))
    assert any(not torch.equal(a[k], b[k]) for k in a if k.endswith(".qweight"))


def test_cli_defaults_are_gptq_group_search_and_refinement(tmp_path, tiny_llama_dir, capsys):
    """Session 18: `pagellm quantize --method awq` rounds with GPTQ + group search + 2 refinement sweeps unless told
    otherwise; `--rounding rtn --no-group-search --refine-sweeps 0` is AutoAWQ's recipe (quantize_model_awq's defaults)."""
    from pagellm.entrypoints.cli import main

    base = ["quantize", "--method", "awq", "--model", str(tiny_llama_dir), "--group-size", "32", "--num-samples", "2",
            "--seq-len", "16"]
    assert main(base + ["--output", str(tmp_path / "default")]) == 0
    out = capsys.readouterr().out
    assert "rounding gptq, group search on" in out and "refine sweeps 2" in out
    assert main(base + ["--output", str(tmp_path / "rtn"), "--rounding", "rtn", "--no-group-search",
                        "--refine-sweeps", "0"]) == 0
    out = capsys.readouterr().out
    assert "rounding rtn, group search off" in out and "refine sweeps 0" in out


def test_cli_parser_defaults():
    """The command's defaults (session 18): 128 calibration samples, GPTQ, group search, 2 refinement sweeps, GPTQ
    damping 1 %, AutoAWQ's RTN-judged scale search."""
    import argparse

    from pagellm.entrypoints.quantize import add_quantize_parser

    parser = argparse.ArgumentParser()
    add_quantize_parser(parser.add_subparsers())
    a = parser.parse_args(["quantize", "--method", "awq", "--output", "x"])
    assert (a.num_samples, a.seq_len, a.rounding, a.group_search, a.refine_sweeps, a.gptq_damp, a.scale_search) == (
        128, 256, "gptq", True, 2, 0.01, "rtn")
