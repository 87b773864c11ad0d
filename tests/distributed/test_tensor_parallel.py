"""Tensor parallelism (TP=2 over the "mp" executor, gloo on CPU) against TP=1 in process, on tiny random
checkpoints: greedy tokens identical and prompt logprobs within 1e-5 (float32); bad set-ups refused at
start-up; a worker killed mid-generation fails the running requests and leaves no process behind.

Every wait of the mp executor is bounded (PAGELLM_MP_STEP_TIMEOUT_S, set low here), so no test can hang.
Each TP=2 engine costs a few seconds of start-up (two spawned interpreters importing torch), so the file
builds two: Llama (GQA, 2 KV heads split, untied head, a vocabulary that does not divide by 2) and Qwen3
(q/k norms, 1 KV head replicated on both ranks, tied embeddings); the kill test reuses the Llama one last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
import transformers as tf

from parallel_helpers import (  # noqa: F401  (bounded_waits: an autouse fixture)
    PROMPTS, assert_same_outputs, bounded_waits, generate_greedy, make_llm, write_tiny_checkpoint,
)
from pagellm import SamplingParams
from pagellm.config import EngineArgs, ParallelConfig
from pagellm.distributed.sharding import partition_heads, vocab_range
from pagellm.distributed.validation import check_tensor_parallel
from pagellm.engine.mp_executor import per_rank_config

pytest.importorskip("pagellm._C", reason="the engine needs the compiled scheduler (run `make install`)")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tiny_tokenizer):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tp") / "llama", tiny_tokenizer, tf.LlamaConfig, tf.LlamaForCausalLM,
        num_key_value_heads=2, head_dim=16, attention_bias=True)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tiny_tokenizer):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tp") / "qwen3", tiny_tokenizer, tf.Qwen3Config, tf.Qwen3ForCausalLM,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def llama_tp2(llama_dir):
    llm = make_llm(llama_dir, tp=2)
    yield llm
    llm.shutdown()


def test_llama_gqa_tp2_matches_tp1(llama_dir, llama_tp2):
    ref_llm = make_llm(llama_dir, tp=1)
    ref = generate_greedy(ref_llm)
    assert llama_tp2.llm_engine.config.parallel_config.distributed_executor_backend == "mp"
    infos = llama_tp2.collective_rpc("describe")
    assert [i["rank"] for i in infos] == [0, 1]
    # each rank caches its 1 of the 2 KV heads: half of TP=1's bytes per token
    assert infos[0]["kv_cache_bytes_per_token"] * 2 == ref_llm.collective_rpc("describe")[0]["kv_cache_bytes_per_token"]
    assert_same_outputs(ref, generate_greedy(llama_tp2))
    # a weight update with full HF tensors: every rank keeps its slices, as a fresh load would
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(1)
    changed = [(n, t * 1.5 + 0.05 * torch.randn(t.shape, generator=g))
               for n, t in load_file(str(llama_dir / "model.safetensors")).items() if "norm" not in n]
    for llm in (ref_llm, llama_tp2):
        llm.llm_engine.update_weights(changed)
    updated = generate_greedy(ref_llm)
    assert [o.outputs[0].token_ids for o in updated] != [o.outputs[0].token_ids for o in ref]
    assert_same_outputs(updated, generate_greedy(llama_tp2))


def test_qwen3_replicated_kv_head_tied_embeddings_tp2_matches_tp1(qwen3_dir):
    ref = generate_greedy(make_llm(qwen3_dir, tp=1))
    llm = make_llm(qwen3_dir, tp=2)
    try:
        assert_same_outputs(ref, generate_greedy(llm))
    finally:
        llm.shutdown()
    assert all(p.exitcode is not None for p in llm.llm_engine.executor.procs)


def test_bad_parallel_config_is_refused_before_any_worker_starts(llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="'mp'"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni")
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    cfg = tf.LlamaConfig(num_attention_heads=6, num_key_value_heads=2, hidden_size=96, intermediate_size=128,
                         architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) is not divisible by tensor_parallel_size \(4\)"):
        check_tensor_parallel(4, cfg, allowed_cpus=8)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) is more than the 1 CPUs"):
        check_tensor_parallel(2, cfg, allowed_cpus=1)
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="no tensor-parallel support"):
        check_tensor_parallel(2, cfg, allowed_cpus=8)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="tensor_parallel_size"):  # 3 ranks: 4 heads do not split (or too few CPUs)
        make_llm(llama_dir, tp=3)
    assert time.monotonic() - t0 < 30


def test_shard_arithmetic():
    # KV heads split when there are enough, else each rank keeps the one its query heads read
    assert [partition_heads(8, 2, r, 4).kv_start for r in range(4)] == [0, 0, 1, 1]
    assert [partition_heads(8, 4, r, 2) for r in range(2)][1].kv_start == 2
    # the ranks share host memory: each sizes its KV cache from 1/tp of the budget
    rank_cc = per_rank_config(EngineArgs(kv_cache_memory_gb=2.0).create_engine_config(512), 2).cache_config
    assert (rank_cc.kv_cache_memory_gb, rank_cc.kv_cache_fraction) == (1.0, 0.45)
    # vocabulary blocks of ceil(V/tp) rows cover every id exactly once
    rows = [vocab_range(321, r, 2) for r in range(2)]
    assert rows == [(0, 161, 161), (161, 160, 161)]


def _fail_on_rank(worker, rank: int):
    if worker.rank == rank:
        raise ValueError(f"refused on rank {worker.rank}")
    return worker.rank


def test_worker_errors_reach_the_caller_and_the_executor_stays_usable(llama_tp2):
    with pytest.raises(ValueError, match="refused on rank 1"):
        llama_tp2.collective_rpc(_fail_on_rank, args=(1,))
    with pytest.raises(TypeError, match="does not pickle"):
        llama_tp2.collective_rpc(lambda w: w.rank)
    with pytest.raises(AttributeError):
        llama_tp2.collective_rpc("no_such_method")
    assert llama_tp2.collective_rpc(_fail_on_rank, args=(5,)) == [0, 1]


def test_mmap_reader_matches_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    from pagellm.distributed.weight_slices import mmap_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(5, 7, generator=g).to(torch.bfloat16), "b": torch.arange(6, dtype=torch.int32),
               "c": torch.randn(3, generator=g), "empty": torch.zeros(0, 4)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    got = dict(mmap_safetensors(tmp_path / "w.safetensors"))
    ref = load_file(str(tmp_path / "w.safetensors"))
    assert sorted(got) == sorted(ref)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    assert torch.equal(got["a"].narrow(1, 3, 4), tensors["a"][:, 3:])  # a rank's columns


def _shm_and_gloo_all_reduce(worker, seed: int):
    import torch.distributed as dist

    from pagellm.distributed import get_tp_state
    from pagellm.distributed.communication import tensor_model_parallel_all_reduce

    state = get_tp_state()
    x = torch.randn(3, 517, generator=torch.Generator().manual_seed(seed + state.rank))
    via_gloo = x.clone()
    dist.all_reduce(via_gloo, group=state.group)
    via_layers = tensor_model_parallel_all_reduce(x.clone())
    return type(state.shm).__name__, via_layers, via_gloo


def test_same_host_ranks_all_reduce_through_shared_memory_and_leave_no_name(llama_tp2):
    replies = llama_tp2.collective_rpc(_shm_and_gloo_all_reduce, args=(3,))
    assert [r[0] for r in replies] == ["ShmCommunicator", "ShmCommunicator"]
    for _, via_shm, via_gloo in replies:  # two fp32 addends: one rounding either way
        assert torch.equal(via_shm, via_gloo) and torch.equal(via_shm, replies[0][1])
    assert [f for f in os.listdir("/dev/shm") if f.startswith(f"pagellm-tp-{os.getpid()}-")] == []


def test_killed_worker_fails_running_requests_and_leaves_no_process(llama_tp2):
    engine = llama_tp2.llm_engine
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    for _ in range(3):
        engine.step()
    victim = engine.executor.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    failed = {}
    while engine.has_unfinished_requests() and time.monotonic() - t0 < 60:
        for out in engine.step():
            if out.finished:
                failed[out.request_id] = out
    assert sorted(failed) == ["r0", "r1", "r2"]
    for out in failed.values():
        assert "rank 1" in out.error and f"pid {victim.pid}" in out.error
        assert out.outputs[0].finish_reason == "error"
    with pytest.raises(RuntimeError, match="rank 1"):  # later calls fail at once
        engine.collective_rpc("describe")
    from pagellm.engine.async_llm import AsyncLLM, EngineDeadError

    server_engine = AsyncLLM(engine)
    with pytest.raises(EngineDeadError, match="rank 1"):  # what /health reports
        asyncio.run(server_engine.check_health())
    server_engine.shutdown()  # also stops the engine's executor
    llama_tp2.shutdown()  # idempotent
    assert all(p.exitcode is not None and not p.is_alive() for p in engine.executor.procs)
