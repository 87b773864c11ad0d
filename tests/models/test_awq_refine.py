"""Session 17's coordinate-descent refinement of a rounded AWQ linear (`awq_refine.py`, `--refine-sweeps`): against
a float64 reference that re-evaluates the whole objective per move, its effect on held-out inputs of Q4_1-grid
weights after GPTQ + group search, bad input, and a refined calibration against HF / LLM(dir)."""

from __future__ import annotations

import pytest
import torch

from pagellm.quantization.awq_calibrate import AWQCalibrationConfig
from pagellm.quantization.awq_gptq import dequantize_groups, gptq_quantize
from pagellm.quantization.awq_refine import REFINE_DAMP, SCALE_STEPS, output_objective, refine_rounding
from pagellm.quantization.awq_search import output_error
from pagellm.quantization.calibration_data import calibration_samples
from test_awq_seq import G, correlated_inputs, gram_of, q4_1_grid_weights

DAMP = 0.01


def reference_refine(w, q, zeros, scales, gram, sweeps):
    """The refinement row by row in float64, every candidate move scored by recomputing e H e^T of the row."""
    h = gram.to(torch.float64).clone()
    h.diagonal().add_(DAMP * h.diagonal().mean())
    q, zeros, scales = q.to(torch.float64).clone(), zeros.to(torch.float64).clone(), scales.to(torch.float64).clone()
    w = w.to(torch.float64)

    def objective(qr, zr, sr, wr):
        e = (qr - zr.repeat_interleave(G)) * sr.repeat_interleave(G) - wr
        return float(e @ h @ e)

    for n in range(w.shape[0]):
        qr, zr, sr, wr = q[n], zeros[n], scales[n], w[n]
        for _ in range(sweeps):
            for g in range(w.shape[1] // G):
                for k in range(g * G, (g + 1) * G):
                    qr[k] = _best_move(objective, (qr, zr, sr, wr), qr, k)
                f0, best, best_scale = objective(qr, zr, sr, wr), 0.0, sr[g].item()
                for r in SCALE_STEPS:
                    for sign in (1.0, -1.0):
                        cand = torch.tensor(sr[g].item() * (1 + sign * r)).to(torch.float16).double().item()
                        old = sr[g].item()
                        sr[g] = cand
                        delta = objective(qr, zr, sr, wr) - f0
                        sr[g] = old
                        if delta < best:
                            best, best_scale = delta, cand
                sr[g] = best_scale
    return q.to(torch.uint8), zeros.to(torch.uint8), scales.to(torch.float16)


def _best_move(objective, state, values, i):
    """The value of values[i] after the best of +-1 (within 0..15) if it lowers the objective, +1 first on ties."""
    f0, old = objective(*state), values[i].item()
    deltas = {}
    for step in (1.0, -1.0):
        if 0 <= old + step <= 15:
            values[i] = old + step
            deltas[step] = objective(*state) - f0
    values[i] = old
    if not deltas:
        return old
    step = min(deltas, key=lambda s: (deltas[s], -s))
    return old + step if deltas[step] < 0 else old


@pytest.mark.parametrize("shape,sweeps,grid", [((24, 96), 1, True), ((13 * 8, 160), 2, True), ((16, 64), 2, False)])
def test_refine_matches_the_float64_reference(shape, sweeps, grid):
    w = q4_1_grid_weights(*shape, seed=21) if grid else torch.randn(shape, generator=torch.Generator().manual_seed(22))
    gram = gram_of(correlated_inputs(600, shape[1], seed=23))
    start = gptq_quantize(w, gram, G, group_search=True)
    got = refine_rounding(w, *start, gram, G, sweeps=sweeps, damp=DAMP)
    want = reference_refine(w, *start, gram, sweeps)
    assert got[0].dtype == torch.uint8 and got[1].dtype == torch.uint8 and got[2].dtype == torch.float16
    assert got[0].max() <= 15 and got[1].max() <= 15 and (got[2] > 0).all()
    for a, b in zip(got, want):
        assert (a == b).float().mean().item() > 0.995
    f_got, f_want = (output_objective(w, *x, gram, G, DAMP) for x in (got, want))
    assert f_got == pytest.approx(f_want, rel=1e-3)
    assert f_got < output_objective(w, *start, gram, G, DAMP)
    assert torch.equal(got[1], start[1])  # zero points stay
    assert not torch.equal(got[0], start[0]) and not torch.equal(got[2], start[2])  # both kinds of move taken


def test_refine_lowers_held_out_error_after_gptq_and_group_search():
    """Calibrated on one draw of x, scored on another (Q4_1-grid weights): each sweep lowers the (damped)
    calibration objective, and two sweeps at the default damping take the held-out output error clearly below
    GPTQ + group search's."""
    w = q4_1_grid_weights(128, 256, seed=24)
    calib, held_out = gram_of(correlated_inputs(2000, 256, 25)), gram_of(correlated_inputs(2000, 256, 26))
    start = gptq_quantize(w, calib, G, group_search=True)
    objectives = [output_objective(w, *start, calib, G, REFINE_DAMP)]
    for sweeps in (1, 2):
        refined = refine_rounding(w, *start, calib, G, sweeps=sweeps)
        objectives.append(output_objective(w, *refined, calib, G, REFINE_DAMP))
    assert objectives[0] > objectives[1] > objectives[2]
    err = [output_error(held_out, dequantize_groups(*x, G) - w) for x in (start, refined)]
    assert err[1] < 0.97 * err[0], err


def test_refine_refuses_bad_input():
    w = torch.randn(8, 64)
    q, zeros, scales = gptq_quantize(w, torch.eye(64), G)
    with pytest.raises(ValueError, match="group_size"):
        refine_rounding(w, q, zeros, scales, torch.eye(64), 48)
    with pytest.raises(ValueError, match="Gram"):
        refine_rounding(w, q, zeros, scales, torch.eye(32), G)
    with pytest.raises(TypeError, match="float16"):
        refine_rounding(w, q, zeros, scales.float(), torch.eye(64), G)
    with pytest.raises(ValueError, match="sweeps"):
        refine_rounding(w, q, zeros, scales, torch.eye(64), G, sweeps=0)
    with pytest.raises(ValueError, match="refine_sweeps"):
        AWQCalibrationConfig(refine_sweeps=-1)
    with pytest.raises(ValueError, match="refine_damp"):
        AWQCalibrationConfig(refine_damp=-0.1)


@pytest.mark.parametrize("rounding", ["rtn", "gptq"])
def test_quantize_linear_refines_with_the_configured_sweeps_and_damping(rounding):
    """`quantize_linear` with refine_sweeps / refine_damp = its rounding, then `refine_rounding` towards the
    unclipped W with those arguments, packed."""
    from pagellm.quantization.awq_calibrate import quantize_linear
    from pagellm.quantization.awq_format import pack_awq, unpack_awq_int4
    from pagellm.quantization.awq_search import InputStats

    w = q4_1_grid_weights(16, 96, seed=27)
    x = correlated_inputs(300, 96, seed=28)
    stats = InputStats.empty(96)
    stats.add(x)
    plain = quantize_linear(w, stats, AWQCalibrationConfig(group_size=G, rounding=rounding), clip=True)
    start = (unpack_awq_int4(plain[0]).t(), unpack_awq_int4(plain[1]).t(), plain[2].t())
    config = AWQCalibrationConfig(group_size=G, rounding=rounding, refine_sweeps=3, refine_damp=0.07)
    got = quantize_linear(w, stats, config, clip=True)
    want = pack_awq(*refine_rounding(w, *start, stats.gram, G, sweeps=3, damp=0.07))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], plain[0])


def test_refined_calibration_reproduces_the_model_and_beats_search(tmp_path, tiny_tokenizer):
    """`calibrate_model` with GPTQ + group search + refinement on a Q4_1-grid Llama: the written directory,
    dequantized into HF transformers, gives exactly the calibrated model's logits; on held-out text they are
    closer to the float model's than without the refinement."""
    from test_awq_seq import _calibrate_and_reload, _q4_1_llama

    src, float_model = _q4_1_llama(tmp_path, tiny_tokenizer)
    samples = calibration_samples(tiny_tokenizer, 8, 64, seed=0)
    held_out = torch.tensor(calibration_samples(tiny_tokenizer, 4, 64, seed=12345))
    errors = {}
    for tag, sweeps in (("search", 0), ("refined", 2)):
        config = AWQCalibrationConfig(group_size=G, rounding="gptq", group_search=True, refine_sweeps=sweeps)
        _, errors[tag] = _calibrate_and_reload(tmp_path, tag, src, float_model, samples, held_out, config)
    assert errors["refined"] < 0.97 * errors["search"], errors


@pytest.mark.parametrize("rounding", ["rtn", "gptq"])
def test_refined_directory_loads_in_pagellm_like_hf(tmp_path, tiny_llama_dir, tiny_tokenizer, rounding):
    """`quantize_model_awq(refine_sweeps=1)` (after RTN + clip search, or GPTQ): LLM(dir) scores a prompt as HF
    transformers does with the directory's dequantized weights."""
    from test_awq_calibrate import _assert_prompt_logprobs_match_hf

    from pagellm.entrypoints.quantize import quantize_model_awq

    out = quantize_model_awq(str(tiny_llama_dir), tmp_path / "refined", group_size=G, num_samples=4, seq_len=32,
                             dtype="float32", rounding=rounding, refine_sweeps=1)
    _assert_prompt_logprobs_match_hf(out, tiny_llama_dir, tiny_tokenizer, max_tokens=1)


def test_cli_takes_refine_sweeps(tmp_path, tiny_llama_dir, capsys):
    from pagellm.entrypoints.cli import main

    out = tmp_path / "cli"
    assert main(["quantize", "--method", "awq", "--model", str(tiny_llama_dir), "--output", str(out),
                 "--group-size", "32", "--num-samples", "2", "--seq-len", "16", "--rounding", "gptq",
                 "--refine-sweeps", "2"]) == 0
    assert "refine sweeps 2" in capsys.readouterr().out
    bad = tmp_path / "bad"
    assert main(["quantize", "--method", "awq", "--model", str(tiny_llama_dir), "--output", str(bad),
                 "--refine-sweeps", "-1"]) == 2
    assert "refine_sweeps must be a non-negative integer, got -1" in capsys.readouterr().err and not bad.exists()
