"""Writing an AutoAWQ-format ("gemm") checkpoint directory that HF transformers and pagellm can load.

    <out>/config.json              the source config + quantization_config (below) + the float dtype
    <out>/model.safetensors        <linear>.qweight / .qzeros / .scales (awq_format.py's layout) for the
                                   decoder linears; every other tensor (embeddings, folded norms, biases,
                                   an untied lm_head) as float in `dtype`
    <out>/tokenizer*, generation_config.json, chat_template.jinja, ...   copied from the source directory
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

AWQ_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
AWQ_FLOAT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
MODULES_NOT_CONVERTED = ["lm_head"]
PACKED_SUFFIXES = (".qweight", ".qzeros", ".scales")
_STALE_FILES = ("model.safetensors.index.json", "quant_config.json")  # would shadow or contradict what is written


def awq_quantization_config(group_size: int) -> dict:
    """The `quantization_config` entry of config.json (AutoAWQ's, as HF transformers' AwqConfig reads it)."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": list(MODULES_NOT_CONVERTED)}


def check_output_dir(output_dir: str | Path, overwrite: bool) -> Path:
    """The output directory, refused (ValueError) when it is a file, or exists non-empty without `overwrite`."""
    out = Path(output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"output directory {out} exists and is not empty; pass --overwrite to replace its files")
    return out


def write_awq_checkpoint(tensors: dict[str, torch.Tensor], source_dir: str | Path, output_dir: str | Path,
                         group_size: int, dtype: str = "float16") -> Path:
    """Write `tensors` (from `calibrate_model`: packed int32 / fp16 AWQ tensors + float tensors) and the
    source directory's config (with `quantization_config`), tokenizer and generation files to `output_dir`
    (weights files and AutoAWQ's quant_config.json already there are removed first)."""
    from safetensors.torch import save_file

    if dtype not in AWQ_FLOAT_DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; allowed: {', '.join(AWQ_FLOAT_DTYPES)}")
    src, out = Path(source_dir), Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), *(out / n for n in _STALE_FILES)]:  # an overwritten checkpoint's
        stale.unlink(missing_ok=True)
    float_dtype = AWQ_FLOAT_DTYPES[dtype]
    stored = {}
    for name, t in tensors.items():
        stored[name] = (t if name.endswith(PACKED_SUFFIXES) else t.to(float_dtype)).contiguous()
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = awq_quantization_config(group_size)
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in AWQ_COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out
