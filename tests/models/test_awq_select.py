"""Session 19's choice among AWQ calibrations by a model-level validation loss (`awq_select.py`,
`pagellm quantize --draws N --select draw|layer`): validation windows that overlap no calibration window, the
scorer's NLL against HF transformers' own loss in float64, the chosen draw / per-layer mix against losses
computed independently, and the written directory in LLM(dir) against HF with its dequantized weights."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from pagellm.quantization.awq_calibrate import AWQCalibrationConfig, calibrate_model, load_float_model
from pagellm.quantization.awq_select import (
    ValidationScorer, combine_layers, layer_state, load_candidate, paired_se, select_calibration, select_draw,
)
from pagellm.quantization.calibration_data import (
    TextWindow, calibration_samples, calibration_windows, doc_pages, kjv_documents, validation_samples,
    validation_windows,
)

G = 32


def test_windows_are_the_samples_and_validation_overlaps_none(tiny_tokenizer):
    """calibration_samples are calibration_windows' ids (so earlier seeds' samples are unchanged), each window's
    ids are its document's tokens there, and validation windows overlap no excluded window nor each other."""
    drawn = [w for seed in (0, 1) for w in calibration_windows(tiny_tokenizer, 8, 64, seed)]
    assert [ids for ids, _ in drawn[:8]] == calibration_samples(tiny_tokenizer, 8, 64, seed=0)
    sources = [s for s in (kjv_documents(), doc_pages()) if s]
    bos = [tiny_tokenizer.bos_token_id] if tiny_tokenizer.bos_token_id is not None else []
    for ids, w in drawn[:3]:
        doc = sources[w.source][w.doc]
        text = doc.read_text(errors="replace") if hasattr(doc, "read_text") else doc
        assert ids == bos + tiny_tokenizer(text, add_special_tokens=False)["input_ids"][w.start:w.end]
    exclude = [w for _, w in drawn]
    val = validation_windows(tiny_tokenizer, 24, 64, exclude=exclude, seed=0)
    assert [ids for ids, _ in val] == validation_samples(tiny_tokenizer, 24, 64, exclude=exclude, seed=0)
    assert val != validation_windows(tiny_tokenizer, 24, 64, exclude=exclude, seed=1)
    windows = [w for _, w in val]
    assert all(len(ids) == 64 for ids, _ in val)
    assert not any(v.overlaps(w) for v in windows for w in exclude)
    assert not any(a.overlaps(b) for i, a in enumerate(windows) for b in windows[i + 1:])
    # the rule is what keeps them apart: the same draw without it overlaps (the tiny tokenizer's long documents
    # make that rare, so a window is excluded on purpose: validation's own first draw)
    first = validation_windows(tiny_tokenizer, 1, 64, exclude=[], seed=0)[0][1]
    assert validation_windows(tiny_tokenizer, 1, 64, exclude=[first], seed=0)[0][1] != first


def test_window_overlap_rule_and_no_room_left(tiny_tokenizer):
    a = TextWindow(0, 3, 10, 20)
    assert a.overlaps(TextWindow(0, 3, 19, 30)) and not a.overlaps(TextWindow(0, 3, 20, 30))
    assert not a.overlaps(TextWindow(1, 3, 10, 20)) and not a.overlaps(TextWindow(0, 4, 10, 20))
    sources = [s for s in (kjv_documents(), doc_pages()) if s]
    everything = [TextWindow(k, d, 0, 10 ** 9) for k, docs in enumerate(sources) for d in range(len(docs))]
    with pytest.raises(ValueError, match="overlaps an excluded one"):
        validation_samples(tiny_tokenizer, 1, 16, exclude=everything)


def _hf_nll64(model, samples) -> float:
    """HF transformers' own mean next-token loss of `samples`, the model in float64."""
    ref = copy.deepcopy(model).double()
    ids = torch.tensor(samples)
    with torch.no_grad():
        return float(ref(ids, labels=ids).loss)


def test_scorer_nll_is_hf_loss_and_tails_agree(tiny_llama_dir, tiny_tokenizer):
    """ValidationScorer.nll() equals HF's float64 loss on the same samples, and the NLL from the residual stream
    before any layer i (`tail_nll`) is the same number."""
    model = load_float_model(str(tiny_llama_dir))
    samples = calibration_samples(tiny_tokenizer, 5, 40, seed=3)  # 5: a partial last batch of 2 with batch_size 3
    scorer = ValidationScorer(model, samples, batch_size=3)
    want = _hf_nll64(model, samples)
    assert scorer.nll() == pytest.approx(want, abs=1e-5)
    for k, ids in enumerate(samples):  # per sample: HF's loss of that sample alone
        assert float(scorer.sample_nlls[k]) == pytest.approx(_hf_nll64(model, [ids]), abs=1e-5)
    hidden = scorer.embed()
    for i in range(len(model.model.layers) + 1):
        assert scorer.tail_nll(i, hidden) == pytest.approx(want, abs=1e-5)
        if i < len(model.model.layers):
            hidden = scorer.run_layer(i, hidden)


def _draws(tiny_llama_dir, tokenizer, seeds=(0, 1, 2)):
    """(float model, [checkpoint tensors of one RTN calibration per seed], [the calibrated models])."""
    config = AWQCalibrationConfig(group_size=G)
    model = load_float_model(str(tiny_llama_dir))
    calibrated = [copy.deepcopy(model) for _ in seeds]
    tensors = [calibrate_model(m, calibration_samples(tokenizer, 2, 24, seed=s), config)
               for m, s in zip(calibrated, seeds)]
    return model, tensors, calibrated


def test_layer_states_rebuild_the_calibrated_model(tiny_llama_dir, tiny_tokenizer):
    """load_candidate(tensors) puts back exactly the weights calibrate_model left in the model it calibrated."""
    model, tensors, calibrated = _draws(tiny_llama_dir, tiny_tokenizer, seeds=(0,))
    scorer = ValidationScorer(copy.deepcopy(model), calibration_samples(tiny_tokenizer, 2, 24, seed=9))
    load_candidate(scorer, tensors[0], G)
    want = dict(calibrated[0].named_parameters())
    for name, p in scorer.model.named_parameters():
        assert torch.equal(p, want[name]), name
    assert set(layer_state(tensors[0], 1, G)) == {n for n, _ in calibrated[0].model.layers[1].named_parameters()}


def _independent_nll(model, tensors, samples) -> float:
    """The checkpoint's float64 HF loss, its weights loaded without awq_select (test_awq_calibrate's way)."""
    from safetensors.torch import save_file
    from test_awq_calibrate import _dequantized_state_dict
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(Path(d) / "model.safetensors"))
        (Path(d) / "config.json").write_text(json.dumps({"quantization_config": {"group_size": G}}))
        state = _dequantized_state_dict(Path(d))
    ref = copy.deepcopy(model)
    ref.load_state_dict(state, strict=True)
    return _hf_nll64(ref, samples)


def scorer_draws(model, tensors, val):
    scorer = ValidationScorer(copy.deepcopy(model), val)
    select_draw(scorer, tensors, G)
    return scorer.draw_sample_nlls


def test_select_draw_and_layers_against_independent_losses(tiny_llama_dir, tiny_tokenizer):
    """select_draw returns every draw's NLL as HF's float64 loss gives it and the least one; the greedy per-layer
    mix's tensors are those draws' layers, its NLL is their independent loss, no worse than the best draw's, and
    its last layer is the best of the draws' last layers with the earlier layers as chosen."""
    model, tensors, _ = _draws(tiny_llama_dir, tiny_tokenizer)
    val = validation_samples(tiny_tokenizer, 4, 32, exclude=[], seed=5)
    want = [_independent_nll(model, t, val) for t in tensors]
    best, losses = select_draw(ValidationScorer(copy.deepcopy(model), val), tensors, G)
    assert losses == pytest.approx(want, abs=1e-5) and best == min(range(3), key=want.__getitem__)
    d = torch.tensor([_independent_nll(model, tensors[0], [s]) - _independent_nll(model, tensors[best], [s])
                      for s in val], dtype=torch.float64)
    per_sample = scorer_draws(model, tensors, val)
    assert paired_se(per_sample[0], per_sample[best]) == pytest.approx(float(d.std() / len(val) ** 0.5), rel=1e-3)

    mixed, report = select_calibration(copy.deepcopy(model), tensors, val, G, mode="layer")
    choice = report["layers"]
    assert report["best_draw"] == best and len(choice) == len(model.model.layers)
    for i, k in enumerate(choice):
        prefix = f"model.layers.{i}."
        assert all(torch.equal(t, tensors[k][n]) for n, t in mixed.items() if n.startswith(prefix))
    assert mixed.keys() == tensors[0].keys()
    assert report["nll"] == pytest.approx(_independent_nll(model, mixed, val), abs=1e-5)
    assert report["nll"] <= min(want) + 1e-6
    last = [_independent_nll(model, combine_layers(tensors, choice[:-1] + [k]), val) for k in range(3)]
    assert min(last) == pytest.approx(report["nll"], abs=1e-5)


def test_select_refuses_bad_arguments(tiny_llama_dir, tiny_tokenizer):
    model = load_float_model(str(tiny_llama_dir))
    with pytest.raises(ValueError, match="select mode"):
        select_calibration(model, [{}], [[1, 2, 3]], G, mode="best")
    with pytest.raises(ValueError, match="at least one"):
        select_calibration(model, [], [[1, 2, 3]], G)


def test_quantize_with_draws_writes_the_chosen_draw_and_loads_like_hf(tmp_path, tiny_llama_dir, tiny_tokenizer):
    """quantize_model_awq(draws=2): the written tensors are exactly those of the single calibration with the seed
    it reports choosing; with select="layer" the directory loads in LLM(dir) scoring a prompt as HF does with its
    dequantized weights."""
    from safetensors.torch import load_file
    from test_awq_calibrate import _assert_prompt_logprobs_match_hf

    from pagellm.entrypoints.quantize import quantize_model_awq

    messages = []
    common = dict(group_size=G, num_samples=2, seq_len=24, dtype="float32", seed=4)
    out = quantize_model_awq(str(tiny_llama_dir), tmp_path / "draw", draws=2, validation_samples=3,
                             progress=messages.append, **common)
    chosen = [m for m in messages if m.startswith("chose ")]
    assert len(chosen) == 1, messages
    k = int(chosen[0].split()[1])
    single = quantize_model_awq(str(tiny_llama_dir), tmp_path / "single", **{**common, "seed": 4 + k})
    got, want = load_file(str(out / "model.safetensors")), load_file(str(single / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in got)

    out = quantize_model_awq(str(tiny_llama_dir), tmp_path / "layer", draws=2, select="layer", validation_samples=3,
                             **common)
    _assert_prompt_logprobs_match_hf(out, tiny_llama_dir, tiny_tokenizer, max_tokens=1)


@pytest.mark.parametrize("bad, match", [(dict(draws=0), "draws"), (dict(draws=1.5), "draws"),
                                        (dict(select="best"), "select"), (dict(validation_samples=0), "validation")])
def test_quantize_refuses_bad_draw_options_before_work(tmp_path, tiny_llama_dir, bad, match):
    from pagellm.entrypoints.quantize import quantize_model_awq

    with pytest.raises(ValueError, match=match):
        quantize_model_awq(str(tiny_llama_dir), tmp_path / "out", **bad)
    assert not (tmp_path / "out").exists()


def test_cli_takes_the_draw_options(tmp_path, tiny_llama_dir, capsys):
    from pagellm.entrypoints.cli import main

    out = tmp_path / "cli"
    assert main(["quantize", "--method", "awq", "--model", str(tiny_llama_dir), "--output", str(out),
                 "--group-size", "32", "--num-samples", "2", "--seq-len", "16", "--rounding", "rtn",
                 "--no-group-search", "--refine-sweeps", "0", "--draws", "2", "--select", "layer",
                 "--validation-samples", "2"]) == 0
    printed = capsys.readouterr().out
    assert "2 draws chosen by layer on 2 validation samples" in printed and "[awq] chose [" in printed
    assert (out / "model.safetensors").is_file()
