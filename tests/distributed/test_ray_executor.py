"""The "ray" executor on a local two-node Ray cluster (ray.cluster_utils.Cluster, 1 CPU per node, so the two
ranks' placement-group bundles land on different nodes): TP=2 through Ray against TP=1 in process on a
tiny random Llama (greedy tokens identical, prompt logprobs within 1e-5, float32); an actor killed
mid-generation fails the running requests naming its rank; a Ray address that does not answer and
mismatched versions are refused at start-up, within a bounded time, naming the problem.
"""

from __future__ import annotations

import argparse
import time

import pytest
import torch
import transformers as tf

from parallel_helpers import drain_after_rank_death, ray_two_node_cluster

pytest.importorskip("pagellm._C", reason="the engine needs the compiled scheduler (run `make install`)")
ray = pytest.importorskip("ray", reason="the ray executor needs Ray (pip install ray; part of the test extra)")

from ray.util import placement_group_table  # noqa: E402

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.config import EngineArgs, ParallelConfig  # noqa: E402
from pagellm.distributed.cli_args import add_parallel_args, parallel_engine_kwargs  # noqa: E402
from pagellm.engine.ray_executor import check_node_versions, connect_ray  # noqa: E402
from pagellm.engine.ray_worker import local_versions  # noqa: E402

PROMPTS = [list(range(5, 11)), list(range(20, 57)), [7, 300, 3, 3, 3, 41, 99, 250, 18]]
NEW_TOKENS = 12
TOL = 1e-5
two_node_cluster = pytest.fixture(scope="module")(ray_two_node_cluster)  # 1 CPU per node, waits bounded


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tiny_tokenizer):
    cfg = tf.LlamaConfig(vocab_size=len(tiny_tokenizer) + 1, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         rms_norm_eps=1e-5, bos_token_id=tiny_tokenizer.bos_token_id,
                         eos_token_id=tiny_tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger logits than the default init: fewer argmax near-ties
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp("ray") / "llama"
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer.save_pretrained(path)
    return path


def _llm(path, tp: int, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=256, block_size=16,
               tensor_parallel_size=tp, **kwargs)


def _generate(llm: LLM):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0, logprobs=0,
                            detokenize=False)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


@pytest.fixture(scope="module")
def ray_tp2(two_node_cluster, llama_dir):
    llm = _llm(llama_dir, 2, distributed_executor_backend="ray")
    yield llm
    llm.shutdown()


def test_tp2_over_ray_on_two_nodes_matches_tp1(llama_dir, ray_tp2):
    ref = _generate(_llm(llama_dir, 1))
    executor = ray_tp2.llm_engine.executor
    assert type(executor).__name__ == "RayExecutor"
    assert len({info["node_id"] for info in executor.node_infos}) == 2  # one rank per simulated node
    assert [i["rank"] for i in ray_tp2.collective_rpc("describe")] == [0, 1]
    assert ray_tp2.collective_rpc(lambda w: w.rank) == [0, 1]  # callables travel by cloudpickle
    got = _generate(ray_tp2)
    for a, b in zip(ref, got, strict=True):
        assert getattr(b, "error", None) is None
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for tok, la, lb in zip(a.prompt_token_ids[1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert abs(la[tok].logprob - lb[tok].logprob) <= TOL
        for tok, la, lb in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(la[tok].logprob - lb[tok].logprob) <= TOL


def test_worker_errors_reach_the_caller_and_the_executor_stays_usable(ray_tp2):
    def fail_on_rank_1(worker):
        if worker.rank == 1:
            raise ValueError(f"refused on rank {worker.rank}")
        return worker.rank

    with pytest.raises(ValueError, match="refused on rank 1"):
        ray_tp2.collective_rpc(fail_on_rank_1)
    with pytest.raises(AttributeError):
        ray_tp2.collective_rpc("no_such_method")
    assert ray_tp2.collective_rpc(lambda w: w.rank) == [0, 1]


def test_killed_actor_fails_running_requests_naming_its_rank(ray_tp2):
    engine = ray_tp2.llm_engine
    executor = engine.executor
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    for _ in range(3):
        engine.step()
    ray.kill(executor.actors[1], no_restart=True)
    assert sorted(drain_after_rank_death(engine)) == ["r0", "r1", "r2"]
    with pytest.raises(RuntimeError, match="rank 1"):  # the executor is broken: later calls fail at once
        engine.collective_rpc("describe")
    ray_tp2.shutdown()  # idempotent
    assert placement_group_table(executor.placement_group)["state"] == "REMOVED"


def test_address_that_does_not_answer_is_refused_in_bounded_time(llama_dir, two_node_cluster):
    for address in ("10.255.255.1:6379", "127.0.0.1:9"):  # unroutable (a timeout), a closed port (refused)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=f"Ray address '{address}' does not answer"):
            _llm(llama_dir, 2, distributed_executor_backend="ray", ray_address=address)
        assert time.monotonic() - t0 < 20
    connect_ray(two_node_cluster.address, 3.0)  # a real GCS passes the same probe


def test_bad_ray_options_and_version_mismatch_are_refused():
    with pytest.raises(ValueError, match="ray_placement_strategy must be one of"):
        ParallelConfig(2, "ray", ray_placement_strategy="EVERYWHERE")
    with pytest.raises(ValueError, match="ray_address is used by distributed_executor_backend='ray' only"):
        EngineArgs(tensor_parallel_size=2, ray_address="10.0.0.1:6379")
    assert EngineArgs(tensor_parallel_size=2, distributed_executor_backend="ray", ray_placement_strategy="SPREAD",
                      ).create_engine_config(256).parallel_config.ray_placement_strategy == "SPREAD"
    parser = argparse.ArgumentParser()
    add_parallel_args(parser)
    args = parser.parse_args(["-tp", "2", "--distributed-executor-backend", "ray", "--ray-address", "h:6379",
                              "--ray-placement-strategy", "SPREAD"])
    kwargs = parallel_engine_kwargs(args)
    assert EngineArgs(**kwargs).create_engine_config(256).parallel_config == ParallelConfig(
        2, "ray", ray_address="h:6379", ray_placement_strategy="SPREAD")
    with pytest.raises(ValueError, match="must be 'host:port'"):
        connect_ray("headnode", 1.0)
    mine = local_versions()
    node = {"ip": "10.0.0.7", "hostname": "gpu-b", "node_id": "ab" * 28, "pid": 1}
    check_node_versions(mine, [dict(node, versions=dict(mine))])  # same versions: accepted
    other = dict(node, versions=dict(mine, torch="0.0.1"))
    with pytest.raises(ValueError, match=r"Ray node 10\.0\.0\.7 \(host gpu-b.*rank 1.*torch 0\.0\.1 \(driver: "):
        check_node_versions(mine, [dict(node, versions=dict(mine)), other])
