"""Helpers of the tensor- / pipeline-parallel tests (a plain module, not a conftest: a second conftest
module would shadow tests/engine's, see git log 87d2d34): tiny random checkpoints, one greedy generation
with prompt logprobs, and the comparison of a split run against the single-rank one."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pagellm import LLM, SamplingParams

PROMPTS = [list(range(5, 11)), list(range(20, 57)), [7, 300, 3, 3, 3, 41, 99, 250, 18]]
NEW_TOKENS = 16
TOL = 1e-5  # float32: a split run differs from one rank by the order of a few sums


@pytest.fixture(autouse=True, scope="module")
def bounded_waits():
    """Every wait of the mp executor bounded (PAGELLM_MP_STEP_TIMEOUT_S), so no test can hang."""
    old = os.environ.get("PAGELLM_MP_STEP_TIMEOUT_S")
    os.environ["PAGELLM_MP_STEP_TIMEOUT_S"] = "120"
    yield
    if old is None:
        os.environ.pop("PAGELLM_MP_STEP_TIMEOUT_S")
    else:
        os.environ["PAGELLM_MP_STEP_TIMEOUT_S"] = old


def write_tiny_checkpoint(path, tokenizer, cfg_cls, model_cls, **overrides):
    """A random-weight HF checkpoint (hidden 64, 4 heads, float32) with the tokenizer, saved to `path`."""
    fields = dict(vocab_size=len(tokenizer) + 1, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    cfg = cfg_cls(**{**fields, **overrides})
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # larger logits than the default init: fewer argmax near-ties
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.dim() >= 2 else p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def write_pp_llama(directory, tokenizer):
    """The pipeline tests' Llama: 4 layers (2 + 2 at PP=2), GQA with 2 KV heads, an untied LM head."""
    import transformers as tf  # noqa: PLC0415

    return write_tiny_checkpoint(directory / "llama4", tokenizer, tf.LlamaConfig, tf.LlamaForCausalLM,
                                 num_hidden_layers=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


def write_pp_qwen3(directory, tokenizer):
    """The pipeline tests' Qwen3: 3 layers (2 + 1 at PP=2), one KV head, tied embeddings."""
    import transformers as tf  # noqa: PLC0415

    return write_tiny_checkpoint(directory / "qwen3", tokenizer, tf.Qwen3Config, tf.Qwen3ForCausalLM,
                                 num_hidden_layers=3, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)


def assert_pipeline_drained(engine) -> None:
    """No request left, no step in flight in the engine or the scheduler, every KV block free."""
    assert not engine.has_unfinished_requests() and engine.num_steps_in_flight == 0
    assert engine.scheduler.num_steps_in_flight == 0
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks  # no leaked KV block


def drain_after_rank_death(engine, timeout_s: float = 60.0) -> dict:
    """Step a engine whose rank 1 was killed until its requests end: {request id: final output}. Asserts that
    it ends within `timeout_s` and that every request failed naming rank 1."""
    t0, failed = time.monotonic(), {}
    while engine.has_unfinished_requests() and time.monotonic() - t0 < timeout_s:
        for out in engine.step():
            if out.finished:
                failed[out.request_id] = out
    assert time.monotonic() - t0 < timeout_s
    for out in failed.values():
        assert "rank 1" in out.error and out.outputs[0].finish_reason == "error"
    return failed


def run_requests(engine, requests: dict, on_step=None) -> dict:
    """Adds `requests` ({request id: (prompt ids, SamplingParams)}), steps until none is left (calling
    `on_step(engine)` after each step); the final RequestOutput of each."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if on_step is not None:
            on_step(engine)
    return final


def assert_same_request(ref, got) -> None:
    """One request's outputs: no error, identical tokens; prompt and sampled logprobs within TOL."""
    assert getattr(got, "error", None) is None, got.error
    a, b = ref.outputs[0], got.outputs[0]
    assert a.token_ids == b.token_ids
    for tok, la, lb in zip(a.token_ids, a.logprobs, b.logprobs):
        assert abs(la[tok].logprob - lb[tok].logprob) <= TOL
    if ref.prompt_logprobs is not None:
        assert len(got.prompt_logprobs) == len(ref.prompt_logprobs) == len(ref.prompt_token_ids)
        for tok, la, lb in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:], got.prompt_logprobs[1:]):
            assert abs(la[tok].logprob - lb[tok].logprob) <= TOL


def make_llm(path, tp: int = 1, pp: int = 1, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=256, block_size=16,
               tensor_parallel_size=tp, pipeline_parallel_size=pp, **kwargs)


RAY_BOUNDED_WAITS = {"PAGELLM_RAY_STEP_TIMEOUT_S": "120", "PAGELLM_RAY_PLACEMENT_TIMEOUT_S": "60",
                     "PAGELLM_RAY_CONNECT_TIMEOUT_S": "3", "PAGELLM_NUM_THREADS": "1"}


def ray_two_node_cluster():
    """A local Ray cluster of a head and a worker node of 1 CPU each (ray.cluster_utils.Cluster), joined by
    this process (the executor reuses ray.init), with every Ray wait bounded; a generator for a
    module-scoped fixture: `two_node_cluster = pytest.fixture(scope="module")(ray_two_node_cluster)`."""
    import ray  # noqa: PLC0415
    from ray.cluster_utils import Cluster  # noqa: PLC0415

    old = {k: os.environ.get(k) for k in RAY_BOUNDED_WAITS}
    os.environ.update(RAY_BOUNDED_WAITS)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def generate_greedy(llm: LLM):
    """PROMPTS, NEW_TOKENS greedy tokens each, with prompt and sampled-token logprobs."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0, logprobs=0,
                            detokenize=False)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def assert_same_outputs(ref, got) -> None:
    """Identical greedy tokens; every prompt and sampled-token logprob within TOL."""
    assert len(ref) == len(got) == len(PROMPTS)
    for a, b in zip(ref, got):
        assert getattr(b, "error", None) is None
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for tok, la, lb in zip(a.prompt_token_ids[1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert abs(la[tok].logprob - lb[tok].logprob) <= TOL
        for tok, la, lb in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(la[tok].logprob - lb[tok].logprob) <= TOL


def split_run_matches_single_rank(path, *, tp: int = 1, pp: int = 1, probe=None):
    """Runs `path` on one rank in process and split over the mp executor; asserts the outputs match and
    every worker process is gone after shutdown. Returns `collective_rpc(probe)` of the split run (None
    without a probe)."""
    ref = generate_greedy(make_llm(path))
    llm = make_llm(path, tp=tp, pp=pp)
    try:
        assert llm.llm_engine.config.parallel_config.distributed_executor_backend == "mp"
        assert_same_outputs(ref, generate_greedy(llm))
        probed = None if probe is None else llm.collective_rpc(probe)
    finally:
        llm.shutdown()
    assert all(p.exitcode is not None for p in llm.llm_engine.executor.procs)
    return probed
