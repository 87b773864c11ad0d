"""`pagellm quantize --method int8`: each decoder linear's weight rows clipped where that lowers the int8 rounding
error the calibration activations see ("awmse"), written as a float checkpoint whose `quantization_config` says
int8.

The loader quantizes every row by its absmax (`quantize_weight_rows`), so a row clipped to +-c is quantized with
the scale c / 127: the written checkpoint *is* the clip choice, in no new format. Per row, c = r * absmax for r on
a grid from 1 down to `min_ratio`, the one of least sum_k E[x_k^2] (w_k - dq(w)_k)^2, where E[x_k^2] is the mean
square of input column k over the calibration tokens (every token's error on the output, summed, in the
diagonal approximation). Each candidate is quantized exactly as the loader will quantize it (the clipped row
rounded to the stored dtype, then `quantize_weight_rows`), so the error searched is the loaded model's. The
unclipped elements keep their values; only the LM head, embeddings and norms are converted to the stored dtype.
Under tensor parallelism each rank quantizes its own slice of a row-parallel layer's columns, whose absmax may be
below the clip: those ranks lose part of the choice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from pagellm.quantization.awq_calibrate import LAYER_LINEARS
from pagellm.quantization.int8 import dequantize_weight_rows, quantize_weight_rows

CLIP_NUM_RATIOS = 20
CLIP_MIN_RATIO = 0.6
INT8_STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def clip_rows(w: torch.Tensor, col_weight: torch.Tensor, store_dtype: torch.dtype = torch.float32,
              num_ratios: int = CLIP_NUM_RATIOS, min_ratio: float = CLIP_MIN_RATIO) -> torch.Tensor:
    """w [rows, in] float32, col_weight [in] (>= 0) -> w with each row clipped to +-r * absmax (r = 1: unclipped)
    for the r of least col_weight-weighted squared error of the row as the loader quantizes it, in store_dtype.
    A row keeps r = 1 unless a smaller r is strictly better."""
    w = w.float()
    absmax = w.abs().amax(dim=1, keepdim=True)

    def error(candidate: torch.Tensor) -> torch.Tensor:
        dq = dequantize_weight_rows(*quantize_weight_rows(candidate))
        return ((dq - w).square_() * col_weight[None, :]).sum(dim=1)

    best = w.to(store_dtype)
    best_err = error(best)
    for i in range(1, num_ratios):
        c = absmax * (1.0 - (1.0 - min_ratio) * i / (num_ratios - 1))
        candidate = torch.minimum(torch.maximum(w, -c), c).to(store_dtype)
        err = error(candidate)
        better = err < best_err
        best = torch.where(better[:, None], candidate, best)
        best_err = torch.where(better, err, best_err)
    return best


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The HF model's decoder projections (q/k/v/o, gate/up/down) by their state-dict prefix."""
    return {f"model.layers.{i}.{name}": layer.get_submodule(name)
            for i, layer in enumerate(model.model.layers) for name in LAYER_LINEARS}


@torch.no_grad()
def input_mean_squares(model: nn.Module, samples: list[list[int]]) -> dict[str, torch.Tensor]:
    """Per decoder linear, the mean of x^2 per input column over every token of `samples` run through the float
    model (forward hooks on the projections' inputs)."""
    linears = decoder_linears(model)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name):
        def record(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + x.square().sum(dim=0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return record

    handles = [linear.register_forward_pre_hook(hook(name)) for name, linear in linears.items()]
    try:
        for sample in samples:
            model(torch.tensor([sample]))
    finally:
        for h in handles:
            h.remove()
    return {name: sums[name] / counts[name] for name in linears}


def clipped_state_dict(model: nn.Module, mean_squares: dict[str, torch.Tensor] | None, store_dtype: torch.dtype,
                       progress: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict in store_dtype with every decoder linear's weight from `clip_rows` (mean_squares
    None: unclipped; a tied LM head left out: the embedding is its weight)."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    state = {name: t.detach().to(store_dtype).contiguous() for name, t in model.state_dict().items()
             if not (tied and name == "lm_head.weight")}
    for i, (name, linear) in enumerate(decoder_linears(model).items() if mean_squares is not None else ()):
        state[f"{name}.weight"] = clip_rows(linear.weight.detach(), mean_squares[name], store_dtype).contiguous()
        if progress is not None and (i + 1) % len(LAYER_LINEARS) == 0:
            progress(f"layer {i // len(LAYER_LINEARS)} clipped")
    return state


def write_int8_checkpoint(state: dict[str, torch.Tensor], source_dir: str | Path, output_dir: Path, dtype: str,
                          quantization_config: dict) -> Path:
    """`state` as model.safetensors, the source's config.json with `quantization_config` and `dtype`, and its
    tokenizer / generation files, into output_dir (checked by awq_export.check_output_dir; old weights removed)."""
    import json
    import shutil

    from safetensors.torch import save_file

    from pagellm.quantization.awq_export import AWQ_COPIED_FILES

    src = Path(source_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*output_dir.glob("*.safetensors"), output_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    save_file(state, str(output_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    (output_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in AWQ_COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, output_dir / name)
    return output_dir
