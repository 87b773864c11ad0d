"""Pipeline parallelism (PP=2 over the "mp" executor, gloo on CPU) against PP=1 in process, on tiny random
checkpoints: greedy tokens identical and prompt logprobs within 1e-5 (float32); each stage holds only its
layers; bad set-ups refused at start-up, before any worker process starts.

Every wait of the mp executor is bounded (PAGELLM_MP_STEP_TIMEOUT_S, set low here), so no test can hang.
Each PP=2 engine costs a few seconds of start-up (two spawned interpreters importing torch): the file builds
two: Llama with 4 layers (2 + 2, GQA, untied head) and Qwen3 with 3 layers (2 + 1: an odd count; q/k norms;
a tied head, so the last stage keeps the embedding for it).
"""

from __future__ import annotations

import time

import pytest
import torch
import transformers as tf

from parallel_helpers import (  # noqa: F401  (bounded_waits: an autouse fixture)
    assert_same_outputs, bounded_waits, generate_greedy, make_llm, write_tiny_checkpoint,
)
from pagellm.config import EngineArgs, ParallelConfig
from pagellm.distributed import PipelineParallelState, set_pp_state
from pagellm.distributed.pipeline import StageAbsent, stage_layer_range
from pagellm.distributed.validation import check_pipeline_parallel
from pagellm.spec_decode import SpeculativeConfig

pytest.importorskip("pagellm._C", reason="the engine needs the compiled scheduler (run `make install`)")


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory, tiny_tokenizer):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("pp") / "llama4", tiny_tokenizer, tf.LlamaConfig, tf.LlamaForCausalLM,
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def qwen3_tied_dir(tmp_path_factory, tiny_tokenizer):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("pp") / "qwen3", tiny_tokenizer, tf.Qwen3Config, tf.Qwen3ForCausalLM,
        num_hidden_layers=3, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)


def _stage_contents(worker):
    """(layer ids with parameters, has embedding, has LM head, KV-cache layer ids, parameter count)."""
    model = worker.model
    layers = sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if n.startswith("model.layers.")})
    return (layers, not isinstance(model.model.embed_tokens, StageAbsent), not isinstance(model.lm_head, StageAbsent),
            sorted(worker.kv_cache_config.layer_specs), sum(p.numel() for p in model.parameters()))


def _params_of_layers(model, layer_ids) -> int:
    return sum(p.numel() for n, p in model.named_parameters()
               if n.startswith("model.layers.") and int(n.split(".")[2]) in layer_ids)


@pytest.mark.parametrize("fixture", ["llama4_dir", "qwen3_tied_dir"])
def test_pp2_matches_pp1_and_each_stage_holds_only_its_layers(fixture, request):
    path = request.getfixturevalue(fixture)
    ref_llm = make_llm(path, pp=1)
    ref = generate_greedy(ref_llm)
    whole = ref_llm.collective_rpc(_stage_contents)[0]
    embed = sum(p.numel() for _, p in ref_llm.collective_rpc(_named_embed)[0])
    llm = make_llm(path, pp=2)
    try:
        assert llm.llm_engine.config.parallel_config.distributed_executor_backend == "mp"
        assert_same_outputs(ref, generate_greedy(llm))
        stages = llm.collective_rpc(_stage_contents)
        if fixture == "llama4_dir":  # a weight update with every HF tensor: each stage takes its own
            _update_both_and_compare(path, ref_llm, llm, ref)
    finally:
        llm.shutdown()
    assert all(p.exitcode is not None for p in llm.llm_engine.executor.procs)
    num_layers = len(whole[0])
    tied = fixture == "qwen3_tied_dir"
    ranges = [stage_layer_range(num_layers, s, 2) for s in range(2)]
    for s, (layers, has_embed, has_head, kv_layers, _) in enumerate(stages):
        assert layers == list(range(*ranges[s])) == kv_layers
        assert has_embed == (s == 0 or tied) and has_head == (s == 1)
    # the stages' parameters add up to the whole model's (plus the embedding the tied head keeps twice)
    assert stages[0][4] + stages[1][4] == whole[4] + (embed if tied else 0)
    assert stages[0][4] < whole[4] and stages[1][4] < whole[4]


def _update_both_and_compare(path, ref_llm, llm, ref):
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(1)
    changed = [(n, t * 1.5 + 0.05 * torch.randn(t.shape, generator=g))
               for n, t in load_file(str(path / "model.safetensors")).items() if "norm" not in n]
    for engine_llm in (ref_llm, llm):
        engine_llm.llm_engine.update_weights(changed)
    updated = generate_greedy(ref_llm)
    assert [o.outputs[0].token_ids for o in updated] != [o.outputs[0].token_ids for o in ref]
    assert_same_outputs(updated, generate_greedy(llm))


def _named_embed(worker):
    return [(n, p) for n, p in worker.model.named_parameters() if n.startswith("model.embed_tokens.")]


def test_stage_layer_range_is_contiguous_and_even():
    for num_layers in range(1, 9):
        for pp in range(1, num_layers + 1):
            ranges = [stage_layer_range(num_layers, s, pp) for s in range(pp)]
            assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            sizes = [e - s for s, e in ranges]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert stage_layer_range(3, 0, 2) == (0, 2) and stage_layer_range(3, 1, 2) == (2, 3)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\) is more than the model's 2 decoder layers"):
        stage_layer_range(2, 0, 3)


def test_a_stage_model_builds_and_loads_only_its_layers(llama4_dir):
    """In process, with the stage set by hand: the loader skips the other stage's tensors."""
    from pagellm.model_loader import build_model
    from pagellm.model_loader.files import open_model

    files = open_model(str(llama4_dir))
    full = build_model(files, "float32")
    previous = set_pp_state(PipelineParallelState(1, 2, 2, 4, prev_rank=0))
    try:
        stage = build_model(files, "float32")
    finally:
        set_pp_state(previous)
    assert isinstance(stage.model.embed_tokens, StageAbsent) and isinstance(stage.model.layers[0], StageAbsent)
    assert sorted(stage.kv_cache_specs(16, torch.float32)) == [2, 3]
    full_params = dict(full.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, full_params[name])  # the same tensors as the whole model's, loaded by HF name
    assert sum(p.numel() for p in stage.parameters()) == (
        _params_of_layers(full, {2, 3}) + full.model.norm.weight.numel() + full.lm_head.weight.numel())


def test_bad_pipeline_config_is_refused_before_any_worker_starts(llama4_dir, monkeypatch):
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        ParallelConfig(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="'mp'"):
        EngineArgs(pipeline_parallel_size=2, distributed_executor_backend="uni")
    assert ParallelConfig(pipeline_parallel_size=2).distributed_executor_backend == "mp"
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2).world_size == 4
    cfg = tf.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\) is more than the model's 2 decoder layers"):
        check_pipeline_parallel(3, 1, cfg, allowed_cpus=8)
    with pytest.raises(ValueError, match=r"2 x 2 = 4 ranks\) is more than the 2 CPUs"):
        check_pipeline_parallel(2, 2, cfg, allowed_cpus=2)
    medusa = SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 2, "model": "/no/heads"})
    with pytest.raises(ValueError, match=r"Medusa is not supported with pipeline_parallel_size=2.*'ngram'"):
        check_pipeline_parallel(2, 1, cfg, speculative_config=medusa, allowed_cpus=8)
    check_pipeline_parallel(2, 1, cfg, speculative_config=SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2}), allowed_cpus=8)  # runs in the driver: accepted
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="no pipeline-parallel support"):
        check_pipeline_parallel(2, 1, cfg, allowed_cpus=8)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(5\) is more than the model's 4 decoder layers"):
        make_llm(llama4_dir, pp=5)
    import pagellm.engine.mp_executor as mp_executor

    monkeypatch.setattr(mp_executor.os, "sched_getaffinity", lambda pid: {0})  # as if this process had one CPU
    with pytest.raises(ValueError, match=r"1 x 2 = 2 ranks\) is more than the 1 CPUs"):
        make_llm(llama4_dir, pp=2)
    assert time.monotonic() - t0 < 30
