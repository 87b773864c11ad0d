"""Decode steps replayed from captured step graphs against the eager module forward, and against HF.

The replay makes the same dispatcher calls, in the same order, with the same kernels as the eager
forward it was recorded from, so greedy tokens and every logprob must be bit-identical, in float32 and
bfloat16, for every architecture. A layer kind written only in Python (here with a Python-defined
custom op) is captured and replayed like the built-in ones.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from paged_model_utils import hf_greedy_batch, make_tiny_hf, random_prompts
from pagellm import LLM, SamplingParams
from pagellm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagellm.models.registry import register_model
from pagellm.ops import ops_available
from test_model_parity import CASES

pytestmark = pytest.mark.skipif(not ops_available()[0], reason="step graphs replay through pagellm._C")

LENGTHS = [1, 17, 45, 140, 3, 60]  # decode batches of 1..6 cross the small-M kernel threshold (4)
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
    return str(tmp_path_factory.mktemp("step_graph"))


def _generate(path: str, prompts, dtype: str, enforce_eager: bool):
    llm = LLM(path, dtype=dtype, enforce_eager=enforce_eager, num_kv_blocks=128, block_size=16,
              max_model_len=256, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs, llm.llm_engine.runner.step_graphs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_replayed_decode_is_bit_identical_to_eager(name, dtype, tmp_root):
    _, path, prompts = _hf_case(name, tmp_root)
    eager_tokens, eager_lps, none = _generate(path, prompts, dtype, enforce_eager=True)
    assert none is None
    tokens, lps, graphs = _generate(path, prompts, dtype, enforce_eager=False)
    assert graphs.num_captures > 0 and graphs.num_replays > 0
    assert tokens == eager_tokens
    assert lps == eager_lps  # exact floats, every step, every request


@pytest.mark.parametrize("name", ["llama", "mistral_sliding", "qwen2_bias", "qwen3"])
def test_replayed_decode_matches_hf_greedy(name, tmp_root):
    hf, path, prompts = _hf_case(name, tmp_root)
    tokens, _, graphs = _generate(path, prompts, "float32", enforce_eager=False)
    assert graphs.num_replays > 0
    assert tokens == hf_greedy_batch(hf, prompts, NEW_TOKENS)


# ---- a layer kind that exists only in Python ----------------------------------------------------
REPLAYED_CALLS = [0]


@torch.library.custom_op("pagellm_test::scaled_tanh_", mutates_args=("x",))
def scaled_tanh_(x: torch.Tensor, gate: torch.Tensor) -> None:
    """x <- x + tanh(x) * gate, in place: a kernel written in Python, reached through the dispatcher."""
    REPLAYED_CALLS[0] += 1
    x.add_(torch.tanh(x) * gate)


class GatedTanhLayer(LlamaDecoderLayer):
    """A Llama layer plus a learned tanh gate on its output: a new layer kind, no C++ written for it."""

    def __init__(self, config, layer_idx, dtype, window_size=-1, **kwargs) -> None:
        super().__init__(config, layer_idx, dtype, window_size, **kwargs)
        self.gate = nn.Parameter(torch.full((config.hidden_size,), 0.5, dtype=dtype), requires_grad=False)

    def forward(self, positions, hidden, residual, ctx):
        out, residual = super().forward(positions, hidden, residual, ctx)
        out = out * 1.25 - 0.5  # plain aten ops with Python scalars
        scaled_tanh_(out, self.gate)
        return out, residual


@register_model("TestGatedTanhForCausalLM")
class GatedTanhForCausalLM(LlamaForCausalLM):
    layer_cls = GatedTanhLayer
    ignored_weight_suffixes = LlamaForCausalLM.ignored_weight_suffixes

    def expected_weight_names(self) -> set[str]:
        return {n for n in super().expected_weight_names() if not n.endswith(".gate")}


def test_a_python_only_layer_kind_is_replayed(tmp_root):
    hf, path, prompts = _hf_case("llama", tmp_root)
    new_path = f"{tmp_root}/gated"
    hf.save_pretrained(new_path)
    config_file = Path(new_path) / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["TestGatedTanhForCausalLM"]
    config_file.write_text(json.dumps(config))
    eager_tokens, eager_lps, _ = _generate(new_path, prompts, "float32", enforce_eager=True)
    REPLAYED_CALLS[0] = 0
    tokens, lps, graphs = _generate(new_path, prompts, "float32", enforce_eager=False)
    assert graphs.num_replays > 0
    # every replayed step ran the Python op once per layer, from C++, through the dispatcher
    assert REPLAYED_CALLS[0] >= graphs.num_replays * config["num_hidden_layers"]
    assert tokens == eager_tokens and lps == eager_lps
    # and the layer changes the result (it is really in the computation)
    plain_tokens, _, _ = _generate(path, prompts, "float32", enforce_eager=False)
    assert plain_tokens != tokens
