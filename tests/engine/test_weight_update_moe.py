"""In-place weight updates of MoE models: HF's per-expert tensors (`experts.{e}.w1.weight`, as save_pretrained
writes Mixtral) and transformers 5.x's stacked ones (`experts.gate_up_proj`) go through FusedMoE's loader;
after the update greedy tokens and logprobs equal a fresh LLM built from the updated checkpoint; a bad expert
tensor anywhere in the call refuses the whole update and changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf

from pagellm import LLM
from pagellm.engine.weight_update import WeightUpdateError
from weight_update_helpers import assert_same, checkpoint, greedy_outputs, perturbed, write_copy

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

CASES = {  # the HF model classes and the tensor names their checkpoints hold for the experts
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32)),
}


def _save(name: str, root: Path, tokenizer) -> Path:
    cfg_cls, model_cls, overrides = CASES[name]
    cfg = cfg_cls(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **overrides)
    torch.manual_seed(5)
    hf = model_cls(cfg).eval()
    with torch.no_grad():  # larger logits than the default init: fewer argmax near-ties
        for p in hf.parameters():
            p.normal_(0.0, 0.08) if p.dim() >= 2 else p.add_(torch.randn_like(p) * 0.05)
    path = root / name
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _llm(path: Path) -> LLM:
    return LLM(str(path), num_kv_blocks=64, max_model_len=128, seed=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("moe_update")
    return {name: _save(name, root, tiny_tokenizer) for name in CASES}


def test_per_expert_update_equals_fresh_llm(saved, tmp_path):
    src = saved["mixtral"]
    weights = perturbed(checkpoint(src))
    assert any(".experts.3.w2.weight" in k for k in weights)  # the checkpoint names experts one by one
    dst = write_copy(src, tmp_path / "perturbed", weights)
    llm = _llm(src)
    before = greedy_outputs(llm)
    assert llm.update_weights(weights.items())["num_tensors"] == len(weights)
    after = greedy_outputs(llm)
    assert_same(after, greedy_outputs(_llm(dst)))
    assert after != before


def test_stacked_expert_update_equals_fresh_llm(saved, tiny_tokenizer, tmp_path):
    """transformers' in-memory state dict (what an RL trainer on HF holds) stacks the experts."""
    src = saved["qwen3_moe"]
    cfg_cls, model_cls, _ = CASES["qwen3_moe"]
    trainer = model_cls.from_pretrained(src, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = trainer.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    trainer.save_pretrained(tmp_path / "trained")
    tiny_tokenizer.save_pretrained(tmp_path / "trained")
    llm = _llm(src)
    llm.update_weights(state.items())
    assert_same(greedy_outputs(llm), greedy_outputs(_llm(tmp_path / "trained")))


@pytest.mark.parametrize("bad, match", [
    (("model.layers.0.block_sparse_moe.experts.9.w1.weight", torch.zeros(128, 64)), r"expert id 9 out of range"),
    (("model.layers.1.block_sparse_moe.experts.0.w2.weight", torch.zeros(128, 64)), r"shape \(128, 64\)"),
])
def test_bad_expert_tensor_changes_nothing(saved, bad, match):
    src = saved["mixtral"]
    llm = _llm(src)
    model = llm.llm_engine.model
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    items = list(perturbed(checkpoint(src)).items())
    items.insert(len(items) // 2, bad)
    with pytest.raises(WeightUpdateError, match=match):
        llm.update_weights(items)
    assert all(torch.equal(before[k], v) for k, v in model.named_parameters())
