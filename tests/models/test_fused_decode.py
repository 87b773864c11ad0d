"""The fused decode path (one torch.ops.pagellm.fused_decode_layer call per decoder layer) against the module
path, and against transformers.

Both paths run the same kernels in the same order, so greedy tokens and every decode logprob must be
bit-identical, in float32 and bfloat16, for every architecture (GQA, biases, q/k norm, sliding window,
tied embeddings). In float32 the fused path must also still reproduce HF's greedy tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch

from paged_model_utils import hf_greedy_batch, make_backend, make_tiny_hf, paged_greedy, random_prompts
from pagellm.model_loader import build_model, open_model
from pagellm.models.llama import LlamaDecoderLayer
from pagellm.ops import ops_available
from test_model_parity import CASES

pytestmark = pytest.mark.skipif(not ops_available()[0], reason="the fused decode op needs pagellm._C")

LENGTHS = [1, 17, 45, 140, 3, 60]  # six requests: decode batches of 1..6 cross the small-M threshold (4)
NEW_TOKENS = 24


@functools.lru_cache(maxsize=None)
def _hf_case(name: str, tmp_root: str):
    cfg_cls, model_cls, overrides = CASES[name]
    hf = make_tiny_hf(cfg_cls, model_cls, seed=len(name) + 1, **overrides)
    path = f"{tmp_root}/{name}"
    hf.save_pretrained(path)
    return hf, path, random_prompts(LENGTHS, hf.config.vocab_size, seed=len(name))


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fused"))


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts LlamaDecoderLayer.fused_decode calls, so a test knows the fused path really ran."""
    calls = [0]
    orig = LlamaDecoderLayer.fused_decode

    def counted(self, *args):
        calls[0] += 1
        return orig(self, *args)

    monkeypatch.setattr(LlamaDecoderLayer, "fused_decode", counted)
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_decode_is_bit_identical_to_module_path(name, dtype, tmp_root, fused_calls):
    hf, path, prompts = _hf_case(name, tmp_root)
    model = build_model(open_model(path), dtype=dtype)
    assert model.supports_fused_decode
    runs = {}
    for fused in (False, True):
        fused_calls[0] = 0
        runs[fused] = paged_greedy(model, make_backend("cpu"), prompts, NEW_TOKENS, 16, seed=3, return_logprobs=True,
                                   fused_decode=fused)
        assert (fused_calls[0] > 0) == fused
    (gen_a, lps_a), (gen_b, lps_b) = runs[False], runs[True]
    assert gen_a == gen_b
    for i, (a, b) in enumerate(zip(lps_a, lps_b)):
        for step, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"{name}/{dtype}: request {i} step {step} logprobs differ"


@pytest.mark.parametrize("name", ["llama", "mistral_sliding", "qwen2_bias", "qwen3"])
def test_fused_decode_matches_hf_greedy(name, tmp_root, fused_calls):
    hf, path, prompts = _hf_case(name, tmp_root)
    model = build_model(open_model(path), dtype="float32")
    gen = paged_greedy(model, make_backend("cpu"), prompts, NEW_TOKENS, 16, seed=5, fused_decode=True)
    assert fused_calls[0] > 0
    assert gen == hf_greedy_batch(hf, prompts, NEW_TOKENS)
