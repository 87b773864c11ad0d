"""Tensor and pipeline parallelism beyond the Llama family, on tiny random checkpoints over the "mp"
executor (2 ranks) against one rank in process: greedy tokens identical, prompt logprobs within 1e-5
(float32). MoE models (Mixtral; Qwen3-MoE with a sparse and a dense layer; Qwen2-MoE's shared expert)
shard every expert's intermediate dimension with one all-reduce after the combine; Gemma 2 / 3 split
heads under soft-capping, sliding layers and 1 + w norms; DeepSeek-V2 splits MLA's heads and replicates its
latent cache. Each stage builds only its layers; bad set-ups (a width or head count not divisible) are
refused at start-up, before any worker starts.

Each 2-rank engine costs a few seconds of start-up (two spawned interpreters importing torch).
"""

from __future__ import annotations

import time

import pytest
import torch
import transformers as tf

from parallel_helpers import bounded_waits, make_llm, split_run_matches_single_rank, write_tiny_checkpoint  # noqa: F401
from pagellm.distributed import set_tp_state
from pagellm.distributed.expert_sharding import plan_experts
from pagellm.distributed.parallel_state import TensorParallelState
from pagellm.distributed.pipeline import StageAbsent, stage_layer_range
from pagellm.distributed.validation import check_pipeline_parallel, check_tensor_parallel

pytest.importorskip("pagellm._C", reason="the engine needs the compiled scheduler (run `make install`)")

S, F = "sliding_attention", "full_attention"
GEMMA3_ROPE = {S: {"rope_type": "default", "rope_theta": 10000.0},
               F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}
CASES = {
    # experts' width 96 -> 48 per rank; 2 KV heads split
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2,
                                                               num_key_value_heads=2, head_dim=16)),
    # layer 0 sparse (8 experts, top-3 renormalized), layer 1 dense; 1 KV head replicated on both ranks
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
        num_key_value_heads=1, head_dim=16)),
    # shared expert (48 wide) summed with the routed ones before the one all-reduce
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False, num_key_value_heads=2)),
    # a sliding layer (window 6) and a global one, both soft-caps on, tied embeddings
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(
        num_key_value_heads=2, head_dim=16, sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=4.0, tie_word_embeddings=True, layer_types=[S, F])),
    # q/k norms, rope per layer type, untied head
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(
        num_key_value_heads=2, head_dim=16, sliding_window=7, query_pre_attn_scalar=24, layer_types=[S, F],
        rope_parameters=GEMMA3_ROPE, final_logit_softcapping=6.0, tie_word_embeddings=False)),
    # MLA (q LoRA): 2 of 4 heads per rank, the latent cache replicated; layer 0 dense, layer 1 MoE with a
    # shared expert and group-limited routing
    "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, dict(
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
        q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("families")
    cache = {}

    def get(name):
        if name not in cache:
            cfg_cls, model_cls, overrides = CASES[name]
            cache[name] = write_tiny_checkpoint(root / name, tiny_tokenizer, cfg_cls, model_cls, **overrides)
        return cache[name]

    return get


def _expert_widths(worker):
    """{FusedMoE name: (intermediate size held, num experts)} on this rank."""
    from pagellm.layers.moe import FusedMoE

    return {n: (m.intermediate_size, m.num_experts) for n, m in worker.model.named_modules() if isinstance(m, FusedMoE)}


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe", "gemma2", "gemma3", "deepseek_v2"])
def test_tp2_matches_tp1(name, checkpoints):
    per_rank = split_run_matches_single_rank(checkpoints(name), tp=2, probe=_expert_widths)
    if name == "mixtral":  # every rank holds all 4 experts of each layer, 48 of their 96 columns
        assert per_rank[0] == per_rank[1] and len(per_rank[0]) == 2
        assert set(per_rank[0].values()) == {(48, 4)}


def _stage_layers(worker):
    """(decoder layer ids with parameters, KV-cache layer ids, has embedding, has LM head) of this stage."""
    model = worker.model
    layers = sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if n.startswith("model.layers.")})
    return (layers, sorted(worker.kv_cache_config.layer_specs), not isinstance(model.model.embed_tokens, StageAbsent),
            not isinstance(model.lm_head, StageAbsent))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gemma2", "deepseek_v2"])
def test_pp2_matches_pp1_and_each_stage_builds_only_its_layers(name, checkpoints):
    stages = split_run_matches_single_rank(checkpoints(name), pp=2, probe=_stage_layers)
    tied = CASES[name][2].get("tie_word_embeddings", False)
    for s, (layers, kv_layers, has_embed, has_head) in enumerate(stages):
        assert layers == kv_layers == list(range(*stage_layer_range(2, s, 2)))
        assert has_embed == (s == 0 or tied) and has_head == (s == 1)


def test_expert_shards_cut_per_expert_and_stacked_tensors_alike():
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(3, 2 * 10, 7, generator=g), torch.randn(3, 7, 10, generator=g)
    previous = set_tp_state(TensorParallelState(rank=1, size=2))
    try:
        shard = plan_experts(10)
        with pytest.raises(ValueError, match=r"moe_intermediate_size \(9\) is not divisible by tensor_parallel_size"):
            plan_experts(9)
    finally:
        set_tp_state(previous)
    assert (shard.start, shard.local) == (5, 5)
    stacked13, stacked2 = shard.slice_stacked(w13, True), shard.slice_stacked(w2, False)
    for e in range(3):
        gate, up = w13[e, :10], w13[e, 10:]
        assert torch.equal(stacked13[e], torch.cat([shard.slice_per_expert(gate, "gate"),
                                                    shard.slice_per_expert(up, "up")]))
        assert torch.equal(stacked13[e, :5], gate[5:]) and torch.equal(stacked2[e], w2[e][:, 5:])
        assert torch.equal(shard.slice_per_expert(w2[e], "down"), w2[e][:, 5:])


def test_bad_family_configs_are_refused_before_any_worker_starts(checkpoints, tmp_path, tiny_tokenizer):
    moe = tf.Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=45,
                            moe_intermediate_size=45, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                            architectures=["Qwen3MoeForCausalLM"])
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(45\) is not divisible by tensor_parallel_size"):
        check_tensor_parallel(2, moe, allowed_cpus=8)
    moe.moe_intermediate_size, moe.mlp_only_layers = 46, [1]  # now a dense layer: its width must split too
    with pytest.raises(ValueError, match=r"^intermediate_size \(45\) is not divisible"):
        check_tensor_parallel(2, moe, allowed_cpus=8)
    moe.mlp_only_layers = []  # every layer sparse: the unused dense width does not matter
    check_tensor_parallel(2, moe, allowed_cpus=8)
    q2 = tf.Qwen2MoeConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, moe_intermediate_size=32,
                           shared_expert_intermediate_size=33, num_experts=4, num_hidden_layers=2,
                           architectures=["Qwen2MoeForCausalLM"])
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size \(33\) is not divisible"):
        check_tensor_parallel(2, q2, allowed_cpus=8)
    gemma = tf.Gemma2Config(num_attention_heads=3, num_key_value_heads=1, hidden_size=48, intermediate_size=64,
                            head_dim=16, architectures=["Gemma2ForCausalLM"])
    with pytest.raises(ValueError, match=r"num_attention_heads \(3\) is not divisible by tensor_parallel_size \(2\)"):
        check_tensor_parallel(2, gemma, allowed_cpus=8)
    deepseek = tf.DeepseekV2Config(architectures=["DeepseekV2ForCausalLM"], num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=45,
                                   first_k_dense_replace=1)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(45\) is not divisible"):
        check_tensor_parallel(2, deepseek, allowed_cpus=8)
    deepseek.first_k_dense_replace, deepseek.intermediate_size = 0, 45  # every layer MoE: the dense width is unused
    deepseek.moe_intermediate_size = 46
    check_tensor_parallel(2, deepseek, allowed_cpus=8)
    check_pipeline_parallel(2, 1, deepseek, allowed_cpus=8)
    cfg_cls, model_cls, overrides = CASES["mixtral"]
    path = write_tiny_checkpoint(tmp_path / "mixtral45", tiny_tokenizer, cfg_cls, model_cls,
                                 **{**overrides, "intermediate_size": 45, "num_attention_heads": 2,
                                    "num_key_value_heads": 2, "head_dim": 32})
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"^intermediate_size \(45\) is not divisible by tensor_parallel_size \(2\)"):
        make_llm(path, tp=2)
    assert time.monotonic() - t0 < 30
