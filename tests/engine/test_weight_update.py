"""LLM.update_weights / update_weights_from_disk: after an update with a perturbed copy of the checkpoint, greedy
tokens and logprobs equal a fresh LLM built from the perturbed checkpoint (float and int8 layouts); bad
updates are refused whole, leaving the old weights intact; the prefix cache is reset by default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.engine.weight_update import WeightUpdateError
from weight_update_helpers import assert_same, checkpoint, greedy_outputs, perturbed, write_copy


def _llm(path: Path, **kw) -> LLM:
    return LLM(str(path), num_kv_blocks=64, max_model_len=128, **kw)


@pytest.fixture(scope="module")
def perturbed_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return write_copy(tiny_llama_dir, tmp_path_factory.mktemp("perturbed") / "m",
                      perturbed(checkpoint(tiny_llama_dir)))


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_update_equals_fresh_llm(tiny_llama_dir, perturbed_dir, quantization):
    llm = _llm(tiny_llama_dir, quantization=quantization)
    before = greedy_outputs(llm)
    fresh = greedy_outputs(_llm(perturbed_dir, quantization=quantization))
    result = llm.update_weights(checkpoint(perturbed_dir).items())
    assert result["num_tensors"] == len(checkpoint(perturbed_dir))
    after = greedy_outputs(llm)
    assert_same(after, fresh)
    assert [t for t, _ in after] != [t for t, _ in before] or after[0][1] != before[0][1]


def test_update_from_disk_and_back(tiny_llama_dir, perturbed_dir):
    llm = _llm(tiny_llama_dir)
    original = greedy_outputs(llm)
    llm.update_weights_from_disk(perturbed_dir)
    assert_same(greedy_outputs(llm), greedy_outputs(_llm(perturbed_dir)))
    llm.update_weights_from_disk(tiny_llama_dir / "model.safetensors")  # one file works too
    assert_same(greedy_outputs(llm), original)


def test_partial_update_in_bf16_from_float32(tiny_llama_dir):
    """A trainer's fp32 tensors into a bf16 model: converted as when loading; only the named tensors change."""
    llm = _llm(tiny_llama_dir, dtype="bfloat16")
    model = llm.llm_engine.model
    new_norm = torch.linspace(0.5, 1.5, model.model.norm.weight.shape[0])
    q = checkpoint(tiny_llama_dir)["model.layers.1.self_attn.q_proj.weight"] * 2
    untouched = model.model.layers[0].mlp.down_proj.weight.clone()
    llm.update_weights([("model.norm.weight", new_norm), ("model.layers.1.self_attn.q_proj.weight", q)])
    assert torch.equal(model.model.norm.weight, new_norm.to(torch.bfloat16))
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(qkv[: q.shape[0]], q.to(torch.bfloat16))
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, untouched)


def _params_snapshot(llm: LLM) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in llm.llm_engine.model.named_parameters()}


@pytest.mark.parametrize("bad, match", [
    (("model.layers.0.no_such.weight", torch.zeros(3)), "has no parameter"),
    (("model.norm.weight", torch.zeros(7)), "shape"),
    (("model.layers.0.self_attn.k_proj.weight", torch.zeros(32, 64, dtype=torch.int32)), "dtype"),
])
def test_bad_tensor_in_the_middle_changes_nothing(tiny_llama_dir, perturbed_dir, bad, match):
    llm = _llm(tiny_llama_dir)
    before_params, before_out = _params_snapshot(llm), greedy_outputs(llm)
    items = list(checkpoint(perturbed_dir).items())
    items.insert(len(items) // 2, bad)
    with pytest.raises(WeightUpdateError, match=match):
        llm.update_weights(items)
    after = _params_snapshot(llm)
    assert all(torch.equal(before_params[k], after[k]) for k in before_params)
    assert_same(greedy_outputs(llm), before_out)


def test_nan_check_is_opt_in(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    norm = llm.llm_engine.model.model.norm.weight
    bad = torch.full_like(norm, float("nan"))
    snapshot = norm.detach().clone()
    with pytest.raises(WeightUpdateError, match="NaN or Inf"):
        llm.update_weights([("model.norm.weight", bad)], check_finite=True)
    assert torch.equal(norm, snapshot)
    llm.update_weights([("model.norm.weight", bad)])  # unchecked: the caller asked for speed
    assert torch.isnan(norm).all()


def test_wrong_types_are_type_errors(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    with pytest.raises(TypeError, match="pairs"):
        llm.update_weights(["model.norm.weight"])
    with pytest.raises(TypeError, match="torch.Tensor"):
        llm.update_weights([("model.norm.weight", [1.0, 2.0])])
    with pytest.raises(TypeError, match="reset_prefix_cache"):
        llm.update_weights([], reset_prefix_cache="yes")


def test_prefix_cache_reset_by_default(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, enable_prefix_caching=True)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(5, 5 + 40))}  # more than two full blocks
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(prompt, params, use_tqdm=False)
    hits0 = engine.get_stats().prefix_cache_hits
    llm.generate(prompt, params, use_tqdm=False)
    hits1 = engine.get_stats().prefix_cache_hits
    assert hits1 > hits0  # cached before any update
    norm = engine.model.model.norm.weight.detach().clone()
    assert llm.update_weights([("model.norm.weight", norm)])["prefix_cache_reset"] is True
    llm.generate(prompt, params, use_tqdm=False)
    assert engine.get_stats().prefix_cache_hits == hits1  # nothing cached survived the update
    assert llm.update_weights([("model.norm.weight", norm)], reset_prefix_cache=False)["prefix_cache_reset"] is False
    llm.generate(prompt, params, use_tqdm=False)
    assert engine.get_stats().prefix_cache_hits > hits1
