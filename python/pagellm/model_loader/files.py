"""Opening a model: an HF-format directory, a .gguf file (converted once), or the default model."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from pagellm.logger import init_logger

logger = init_logger(__name__)

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
GENERATION_CONFIG_NAME = "generation_config.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# generation_config.json keys kept as sampling defaults
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "do_sample", "max_new_tokens", "max_length")


@dataclass
class ModelFiles:
    path: Path                        # the HF-format directory actually loaded
    hf_config: Any                    # transformers.PretrainedConfig
    tokenizer: Any                    # PreTrainedTokenizerBase (fast, with chat_template when available) or None
    generation_config: dict = field(default_factory=dict)  # eos_token_id: list[int] + sampling defaults
    source: Path | None = None        # what the user named (the .gguf file for converted models)


def _eos_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def load_generation_config(path: Path, hf_config, tokenizer) -> dict:
    """generation_config.json as a dict with `eos_token_id` normalized to list[int] (falling back to
    config.json's, then the tokenizer's eos)."""
    gen: dict = {}
    f = path / GENERATION_CONFIG_NAME
    if f.is_file():
        with open(f) as fh:
            raw = json.load(fh)
        gen = {k: v for k, v in raw.items() if not k.startswith("_") and k != "transformers_version"}
    eos = _eos_list(gen.get("eos_token_id"))
    if not eos:
        eos = _eos_list(getattr(hf_config, "eos_token_id", None))
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = [int(tokenizer.eos_token_id)]
    gen["eos_token_id"] = eos
    for key in ("bos_token_id", "pad_token_id"):
        if gen.get(key) is None and getattr(hf_config, key, None) is not None:
            gen[key] = getattr(hf_config, key)
    return gen


def _load_tokenizer(path: Path):
    if not any((path / n).is_file() for n in _TOKENIZER_FILES):
        logger.warning("no tokenizer files in %s; ModelFiles.tokenizer is None", path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def open_hf_dir(path: Path, source: Path | None = None) -> ModelFiles:
    from transformers import AutoConfig

    path = Path(path)
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: missing config file (not an HF-format model directory)")
    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # transformers 5.x type-checks config fields (huggingface_hub's StrictDataclassError)
        if type(e).__name__.startswith("StrictDataclass"):
            raise ValueError(f"{cfg_file}: {e}") from e  # its message names the field
        raise
    if not (path / SAFE_WEIGHTS_INDEX_NAME).is_file() and not list(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{path}: no weights files ({SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME} or *.safetensors)"
        )
    tokenizer = _load_tokenizer(path)
    return ModelFiles(path=path, hf_config=hf_config, tokenizer=tokenizer,
                      generation_config=load_generation_config(path, hf_config, tokenizer), source=source or path)


def open_model(model: str | os.PathLike | None = None) -> ModelFiles:
    """An HF directory, a .gguf file (converted once into the cache), or None/"SmolLM2-135M-Instruct"
    for the default model."""
    from pagellm.model_loader.default_model import DEFAULT_MODEL_NAME, default_model_gguf_path
    from pagellm.model_loader.gguf_convert import gguf_to_hf_dir

    if model is None or str(model) == DEFAULT_MODEL_NAME:
        model = default_model_gguf_path()
    p = Path(model).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"{p}: a model is an HF-format directory or a .gguf file")
        return open_hf_dir(gguf_to_hf_dir(p), source=p)
    if p.is_dir():
        if not (p / CONFIG_NAME).is_file():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return open_hf_dir(gguf_to_hf_dir(ggufs[0]), source=ggufs[0])
        return open_hf_dir(p)
    raise FileNotFoundError(f"{p}: model path does not exist (expected an HF-format directory or a .gguf file)")


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF directory, in load order; missing shards are an error."""
    index = path / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        with open(index) as fh:
            weight_map = json.load(fh).get("weight_map", {})
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: missing weights file (listed in {index})")
        return files
    single = path / SAFE_WEIGHTS_NAME
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no weights files ({SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME})")
    return files


def iter_weights_with_file(files: ModelFiles) -> Iterator[tuple[Path, str, torch.Tensor]]:
    from safetensors import safe_open

    for f in weight_files(Path(files.path)):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield f, name, fh.get_tensor(name)


def tensor_headers(files: ModelFiles) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF tensor name -> (safetensors dtype name, e.g. "F16" / "I32", shape), from the file headers only."""
    from safetensors import safe_open

    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in weight_files(Path(files.path)):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                view = fh.get_slice(name)
                headers[name] = (view.get_dtype(), tuple(view.get_shape()))
    return headers


def iter_weights(files: ModelFiles) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF tensor name, tensor) one at a time, file by file (safetensors safe_open)."""
    for _, name, tensor in iter_weights_with_file(files):
        yield name, tensor
