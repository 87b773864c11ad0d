"""`pagellm quantize --method int8`: the activation-weighted clip search (int8_clip.py) against direct
computations, and the written checkpoint through pagellm's loader (its int8 rows are the searched ones, with
no more activation-weighted error than the plain absmax rows of the same model) and LLM."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pagellm.quantization.int8 import dequantize_weight_rows, quantize_weight_rows
from pagellm.quantization.int8_clip import CLIP_MIN_RATIO, clip_rows, input_mean_squares

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _weighted_error(w_float: torch.Tensor, stored: torch.Tensor, col_weight: torch.Tensor) -> torch.Tensor:
    """Per row: sum_k col_weight[k] (w - dq(quantize_weight_rows(stored)))^2, as the loader quantizes stored."""
    dq = dequantize_weight_rows(*quantize_weight_rows(stored.float()))
    return ((dq - w_float.float()) ** 2 * col_weight).sum(dim=1)


def _rows_with_a_large_element(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows, each with one element 6x larger in one of the first 4 columns."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[torch.arange(rows), torch.randint(0, 4, (rows,), generator=g)] = 0.12
    return w.bfloat16().float()  # representable in the stored dtype: unclipped rows are stored exactly


@pytest.mark.parametrize("store_dtype", [torch.bfloat16, torch.float32])
def test_clip_rows_is_a_row_clip_that_never_loses(store_dtype):
    w = _rows_with_a_large_element(67, 131)
    col_weight = torch.rand(131, generator=torch.Generator().manual_seed(1)) + 0.5
    col_weight[:4] = 0.002  # the large elements' columns see little activation: clipping them pays
    clipped = clip_rows(w, col_weight, store_dtype)
    assert clipped.dtype == store_dtype and clipped.shape == w.shape
    bound = clipped.float().abs().amax(dim=1, keepdim=True)
    assert torch.equal(clipped, torch.minimum(torch.maximum(w, -bound), bound).to(store_dtype))  # a clip per row
    assert (bound[:, 0] >= CLIP_MIN_RATIO * w.abs().amax(dim=1) * (1 - 1e-2)).all()
    err, err_absmax = _weighted_error(w, clipped, col_weight), _weighted_error(w, w, col_weight)
    assert (err <= err_absmax).all()
    assert (err < err_absmax).sum() > 50 and err.sum() < 0.8 * err_absmax.sum()  # most rows gain


def test_clip_rows_follows_the_column_weights():
    """A row whose large element sits in a column no activation reaches is clipped hard (that column's error is
    free), and left alone when that column is the one that matters."""
    w = torch.randn(1, 64, generator=torch.Generator().manual_seed(2)) * 0.01
    w[0, 5] = 0.5
    free = torch.ones(64)
    free[5] = 0.0
    assert clip_rows(w, free)[0].abs().max() < 0.7 * 0.5
    only_5 = torch.zeros(64)
    only_5[5] = 1.0
    assert torch.equal(clip_rows(w, only_5), w)


def test_input_mean_squares_match_the_captured_inputs(tiny_llama_dir):
    from pagellm.quantization.awq_calibrate import load_float_model

    model = load_float_model(str(tiny_llama_dir))
    samples = [[3, 7, 11, 19, 23], [5, 6, 8]]
    stats = input_mean_squares(model, samples)
    assert len(stats) == model.config.num_hidden_layers * len(LINEAR_NAMES)
    seen = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda _m, a: seen.append(a[0][0]))
    with torch.no_grad():
        for s in samples:
            model(torch.tensor([s]))
    handle.remove()
    x = torch.cat(seen)
    torch.testing.assert_close(stats["model.layers.1.mlp.down_proj"], x.square().mean(dim=0), rtol=1e-5, atol=0)


def test_quantize_int8_checkpoint_loads_with_the_searched_rows(tmp_path, tiny_llama_dir, tiny_tokenizer):
    from pagellm import LLM, SamplingParams
    from pagellm.entrypoints.quantize import quantize_model_int8
    from pagellm.layers import Linear
    from pagellm.model_loader import build_model, open_model
    from pagellm.quantization import Int8LinearMethod

    out = quantize_model_int8(str(tiny_llama_dir), tmp_path / "int8", num_samples=4, seq_len=32, dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "int8", "threshold": 6.0, "activation_scheme": "group",
                                             "group_size": 64}
    source, written = load_file(tiny_llama_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(written) == set(source)
    model = build_model(open_model(out))
    assert all(isinstance(m.linear_method, Int8LinearMethod) for m in model.modules() if isinstance(m, Linear))
    down = model.model.layers[0].mlp.down_proj
    q, scale = quantize_weight_rows(written["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(down.weight, q) and torch.equal(down.weight_scale, scale)  # the loader's rows = the stored
    from pagellm.quantization.awq_calibrate import load_float_model
    from pagellm.quantization.calibration_data import calibration_samples

    stats = input_mean_squares(load_float_model(str(tiny_llama_dir)), calibration_samples(tiny_tokenizer, 4, 32, 0))
    num_clipped_rows = 0
    for name, col_weight in stats.items():
        w, stored = source[f"{name}.weight"].float(), written[f"{name}.weight"]
        bound = stored.abs().amax(dim=1, keepdim=True)
        assert torch.equal(stored, torch.minimum(torch.maximum(w, -bound), bound)), name
        assert (_weighted_error(w, stored, col_weight) <= _weighted_error(w, w, col_weight)).all(), name
        num_clipped_rows += int((bound[:, 0] < w.abs().amax(dim=1)).sum())
    for name in source:
        if not any(f".{p}." in name for p in LINEAR_NAMES):
            assert torch.equal(written[name], source[name].float()), name
    assert num_clipped_rows > 0
    llm = LLM(str(out), dtype="float32", max_model_len=128, kv_cache_memory_gb=0.05, seed=0)
    result = llm.generate([{"prompt_token_ids": [3, 9, 27, 81]}], SamplingParams(max_tokens=4, temperature=0.0),
                          use_tqdm=False)[0]
    assert len(result.outputs[0].token_ids) == 4


def test_cli_int8_refuses_bad_input(tmp_path, tiny_llama_dir, capsys):
    from pagellm.entrypoints.cli import main

    for bad in (["--group-size", "48"], ["--dtype", "int8"], ["--num-samples", "0"]):
        argv = ["quantize", "--method", "int8", "--model", str(tiny_llama_dir), "--output", str(tmp_path / "n"), *bad]
        assert main(argv) == 2
        assert "error:" in capsys.readouterr().err and not (tmp_path / "n").exists()
