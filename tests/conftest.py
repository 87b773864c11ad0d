"""Shared fixtures: a tiny byte-level BPE tokenizer and tiny random-weight HF Llama checkpoints (built by
tiny_models.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import importlib.util

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("pagellm") is None:  # not installed yet (`make install`): use the source tree
    sys.path.insert(0, str(ROOT / "python"))

from tiny_models import build_tiny_tokenizer, write_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_long_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """The tiny Llama with an 8192-token context, for tests that need long generations."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-long"), tiny_tokenizer, max_position_embeddings=8192)
