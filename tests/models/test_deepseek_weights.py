"""DeepSeek-V3's expert tensors load through base's expert_params_mapping hook: the per-expert names of a saved
checkpoint, the stacked names of transformers' in-memory state dict (what a trainer sends to update_weights),
V3's multi-token-prediction layers skipped, and a misplaced expert tensor refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from paged_model_utils import make_tiny_hf
from pagellm.model_loader import build_model, open_model
from pagellm.models.base import WeightLoadError

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
           q_lora_rank=None, first_k_dense_replace=1, n_group=2, topk_group=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_tiny_hf(tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, seed=3, **MLA)
    path = tmp_path_factory.mktemp("deepseek_v3")
    hf.save_pretrained(path)
    (file,) = path.glob("*.safetensors")
    return hf, path, load_file(file)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_per_expert_and_stacked_names_load_the_same(checkpoint):
    hf, path, saved = checkpoint
    model = build_model(open_model(path), dtype="float32")
    assert any(".mlp.experts.7.down_proj.weight" in n for n in saved)  # the checkpoint is per expert
    assert model.expected_weight_names() == set(saved)
    from_file = _params(model)
    experts = model.model.layers[1].mlp.experts
    ref = saved["model.layers.1.mlp.experts.5.up_proj.weight"]
    assert torch.equal(experts.w13_weight[5, ref.shape[0]:], ref)  # gate rows, then up rows

    for p in model.parameters():
        p.data.zero_()
    state = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state  # transformers' stacked form
    # a stacked tensor stands for every expert's per-expert names: the load is complete
    assert model.load_weights(state.items()) == model.expected_weight_names()
    for name, value in _params(model).items():
        assert torch.equal(value, from_file[name]), name


def test_mtp_layers_skipped_and_bad_expert_refused(checkpoint):
    _, path, saved = checkpoint
    model = build_model(open_model(path), dtype="float32")
    extra = {"model.layers.2.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64),  # layer 2 of 2: MTP
             "model.layers.2.eh_proj.weight": torch.zeros(64, 128)}
    loaded = model.load_weights([*saved.items(), *extra.items()])
    assert loaded == set(saved)
    with pytest.raises(WeightLoadError, match=r"experts\.8\.gate_proj.*out of range"):
        model.load_weights([("model.layers.1.mlp.experts.8.gate_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(WeightLoadError, match="unexpected tensor"):  # layer 0 is dense: no experts there
        model.load_weights([("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(32, 64))])
