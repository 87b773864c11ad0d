"""Pipeline parallelism over the "ray" executor on a local two-node Ray cluster (ray.cluster_utils.Cluster,
1 CPU per node, so the two stages' placement-group bundles land on different nodes): PP=2 through Ray
against one rank in process on tiny random Llama (4 layers, 2 + 2) and Qwen3 (3 layers, 2 + 1, tied head):
greedy tokens identical, prompt and sampled logprobs within 1e-5 (float32), with two micro-batches in
flight through Ray object refs; an actor of the last stage killed mid-generation fails the running requests
naming its rank, and the driver shuts down cleanly (actors killed, placement group removed).

Each Ray engine costs two actors importing torch: the file builds two and the kill test reuses the Llama one
(and so runs before the Qwen3 test: the cluster's two CPUs hold one engine's actors at a time).
"""

from __future__ import annotations


import pytest

from parallel_helpers import (
    assert_same_outputs,
    drain_after_rank_death,
    generate_greedy,
    make_llm,
    ray_two_node_cluster,
    write_pp_llama,
    write_pp_qwen3,
)

pytest.importorskip("pagellm._C", reason="the engine needs the compiled scheduler (run `make install`)")
ray = pytest.importorskip("ray", reason="the ray executor needs Ray (pip install ray; part of the test extra)")

from ray.util import placement_group_table  # noqa: E402

from pagellm import SamplingParams  # noqa: E402

two_node_cluster = pytest.fixture(scope="module")(ray_two_node_cluster)


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory, tiny_tokenizer):
    return write_pp_llama(tmp_path_factory.mktemp("raypp"), tiny_tokenizer)


@pytest.fixture(scope="module")
def qwen3_tied_dir(tmp_path_factory, tiny_tokenizer):
    return write_pp_qwen3(tmp_path_factory.mktemp("raypp"), tiny_tokenizer)


@pytest.fixture(scope="module")
def ray_llama_pp2(two_node_cluster, llama4_dir):
    llm = make_llm(llama4_dir, pp=2, distributed_executor_backend="ray")
    yield llm
    llm.shutdown()


def _check_stages_on_two_nodes(llm) -> None:
    executor = llm.llm_engine.executor
    assert type(executor).__name__ == "RayExecutor"
    assert executor.max_concurrent_batches == 2  # micro-batches on by default
    assert len({info["node_id"] for info in executor.node_infos}) == 2  # one stage per simulated node
    described = llm.collective_rpc("describe")
    assert [d["rank"] for d in described] == [0, 1]


def test_llama_pp2_over_ray_on_two_nodes_matches_one_rank(llama4_dir, ray_llama_pp2, monkeypatch):
    ref = generate_greedy(make_llm(llama4_dir))
    _check_stages_on_two_nodes(ray_llama_pp2)
    engine = ray_llama_pp2.llm_engine
    steps_in_flight: list[int] = []
    submit = engine._submit

    def recording(sched_out, seq_ids):
        step = submit(sched_out, seq_ids)
        steps_in_flight.append(len(engine._batch_queue) + 1)
        return step

    monkeypatch.setattr(engine, "_submit", recording)
    assert_same_outputs(ref, generate_greedy(ray_llama_pp2))
    assert max(steps_in_flight) == 2  # stage 0 ran a step while stage 1 ran the one before
    # each stage holds its own half of the layers
    layers = ray_llama_pp2.collective_rpc(lambda w: sorted(w.kv_cache_config.layer_specs))
    assert layers == [[0, 1], [2, 3]]


def test_killed_last_stage_actor_fails_running_requests_naming_its_rank(ray_llama_pp2):
    engine = ray_llama_pp2.llm_engine
    executor = engine.executor
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False)
    for i, p in enumerate([list(range(5, 11)), list(range(20, 57)), [7, 300, 3, 3, 41]]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    for _ in range(4):
        engine.step()
    assert engine.num_steps_in_flight >= 1
    ray.kill(executor.actors[1], no_restart=True)
    assert sorted(drain_after_rank_death(engine)) == ["r0", "r1", "r2"]
    assert engine.num_steps_in_flight == 0 and engine.scheduler.num_steps_in_flight == 0
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks  # no KV block leaked
    with pytest.raises(RuntimeError, match="rank 1"):  # the executor is broken: later calls fail at once
        engine.collective_rpc("describe")
    ray_llama_pp2.shutdown()  # idempotent
    assert placement_group_table(executor.placement_group)["state"] == "REMOVED"


def test_qwen3_tied_pp2_over_ray_matches_one_rank(two_node_cluster, qwen3_tied_dir):
    ref = generate_greedy(make_llm(qwen3_tied_dir))
    llm = make_llm(qwen3_tied_dir, pp=2, distributed_executor_backend="ray")
    try:
        _check_stages_on_two_nodes(llm)
        assert_same_outputs(ref, generate_greedy(llm))
    finally:
        llm.shutdown()


def test_bad_pipeline_setups_refused_before_ray_is_asked(llama4_dir, monkeypatch):
    import pagellm.engine.ray_executor as ray_executor

    def must_not_connect(*args, **kwargs):
        raise AssertionError("connect_ray called before the set-up was checked")

    monkeypatch.setattr(ray_executor, "connect_ray", must_not_connect)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(5\) is more than the model's 4 decoder layers"):
        make_llm(llama4_dir, pp=5, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match=r"Medusa is not supported with pipeline_parallel_size=2"):
        make_llm(llama4_dir, pp=2, distributed_executor_backend="ray",
                 speculative_config={"method": "medusa", "num_speculative_tokens": 2, "model": "/no/heads"})
