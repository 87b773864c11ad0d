"""pagellm.threading_config: PAGELLM_NUM_THREADS / PAGELLM_BIND validation, applying them to the kernels'
thread pool and torch, the OpenMP defaults; kernels give the same results at every pool setting."""

from __future__ import annotations

import logging

import pytest
import torch

from pagellm import LLM, SamplingParams, _C
from pagellm.ops import reference
from pagellm.threading_config import (
    OPENMP_SPIN_COUNT,
    ThreadingConfig,
    allowed_cpu_count,
    apply_threading,
    set_openmp_defaults,
)


@pytest.fixture
def restore_threading():
    saved, torch_threads = dict(_C.thread_pool_info()), torch.get_num_threads()
    yield
    _C.configure_thread_pool(saved["num_threads"], bind=saved["bind"], spin_us=saved["spin_us"],
                             chunks_per_thread=saved["chunks_per_thread"], max_backoff_ms=saved["max_backoff_ms"],
                             home_sections=saved["home_sections"], prefetch_kb=saved["prefetch_kb"])
    torch.set_num_threads(torch_threads)


@pytest.mark.parametrize("raw", ["0", "-1", "-8", "two", "1.5", " "])
def test_bad_num_threads_is_a_value_error_with_the_range(raw):
    if not raw.strip():  # blank means unset
        assert ThreadingConfig.from_env({"PAGELLM_NUM_THREADS": raw}).num_threads is None
        return
    with pytest.raises(ValueError, match=rf"PAGELLM_NUM_THREADS.*\[1, {allowed_cpu_count()}\]"):
        ThreadingConfig.from_env({"PAGELLM_NUM_THREADS": raw})


def test_env_defaults_and_bind_modes():
    assert ThreadingConfig.from_env({}) == ThreadingConfig(None, "cores")
    assert ThreadingConfig.from_env({"PAGELLM_NUM_THREADS": "1", "PAGELLM_BIND": "None"}) == ThreadingConfig(1, "none")
    with pytest.raises(ValueError, match="PAGELLM_BIND.*'cores', 'none'"):
        ThreadingConfig.from_env({"PAGELLM_BIND": "sockets"})
    with pytest.raises(ValueError, match="num_threads"):
        ThreadingConfig(num_threads=True)


def test_more_threads_than_cpus_is_clamped_with_a_warning(monkeypatch):
    warnings = []
    monkeypatch.setattr(logging.getLogger("pagellm.threading_config"), "warning",
                        lambda msg, *args: warnings.append(msg % args))
    assert ThreadingConfig(num_threads=64).resolve_num_threads(allowed=2) == 2
    assert len(warnings) == 1 and "2 CPUs" in warnings[0]
    assert ThreadingConfig(num_threads=1).resolve_num_threads(allowed=2) == 1
    assert ThreadingConfig().resolve_num_threads(allowed=3) == 3
    assert len(warnings) == 1


def test_apply_threading_sizes_the_pool_and_torch(restore_threading):
    info = apply_threading(ThreadingConfig(num_threads=1, bind="none"))
    assert info["enabled"] and info["num_threads"] == 1 and info["bind"] is False
    assert torch.get_num_threads() == 1
    info = apply_threading(ThreadingConfig(num_threads=10_000))  # clamped
    assert info["num_threads"] == allowed_cpu_count() == len(_C.allowed_cpus())
    assert torch.get_num_threads() == allowed_cpu_count()


def test_pool_refuses_bad_settings_without_changing_them(restore_threading):
    _C.configure_thread_pool(1)
    for kw in ({"num_threads": -1}, {"num_threads": 5000}, {"num_threads": 1, "spin_us": -1},
               {"num_threads": 1, "chunks_per_thread": 0}, {"num_threads": 1, "max_backoff_ms": -1},
               {"num_threads": 1, "prefetch_kb": -1}):
        with pytest.raises(ValueError, match="configure_thread_pool"):
            _C.configure_thread_pool(**kw)
    assert _C.thread_pool_info()["num_threads"] == 1


def test_openmp_defaults_never_override_the_user():
    env = {}
    set_openmp_defaults(env)
    assert env == {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}
    env = {"GOMP_SPINCOUNT": "5"}
    set_openmp_defaults(env)
    assert env == {"GOMP_SPINCOUNT": "5"}
    for env in ({"OMP_WAIT_POLICY": "active"}, {"PAGELLM_THREAD_POOL": "0"}):
        before = dict(env)
        set_openmp_defaults(env)
        assert env == before


@pytest.mark.parametrize("num_threads,bind,chunks,home", [(1, True, 4, True), (2, True, 1, True), (2, False, 4, True),
                                                          (8, False, 64, True), (2, True, 4, False), (3, False, 2, False)])
def test_kernels_agree_with_the_reference_at_every_pool_setting(restore_threading, num_threads, bind, chunks, home):
    _C.configure_thread_pool(num_threads, bind=bind, chunks_per_thread=chunks, home_sections=home)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 512, generator=g)
    w = torch.randn(2051, 512, generator=g)  # odd N: a partial last tile
    out = torch.empty(3, 2051)
    torch.ops.pagellm.linear_small_m(out, x, w, None)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-4, atol=1e-3)
    rows = torch.randn(1000, 96, generator=g)
    weight = torch.randn(96, generator=g)
    normed = torch.empty_like(rows)
    torch.ops.pagellm.rms_norm(normed, rows, weight, 1e-6)
    expected = torch.empty_like(rows)
    reference.rms_norm(expected, rows, weight, 1e-6)
    torch.testing.assert_close(normed, expected)


def test_next_weight_prefetch_runs_and_changes_no_bits(restore_threading):
    """M = 1 linears called in a repeating order (a decode step's projections): with home sections and
    prefetch_kb the pool's idle worker prefetches the weight that comes next (prefetched_bytes grows), and
    every output is bitwise the one of the interleaved pool without prefetch."""
    import time

    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(n, k, generator=g).to(torch.bfloat16) for n, k in ((963, 576), (576, 576), (3072, 576), (577, 1536))]
    xs = [torch.randn(1, w.shape[1], generator=g).to(torch.bfloat16) for w in ws]

    def run(rounds: int) -> list[torch.Tensor]:
        outs = []
        for _ in range(rounds):
            for x, w in zip(xs, ws):
                out = torch.empty(1, w.shape[0], dtype=torch.bfloat16)
                torch.ops.pagellm.linear_small_m(out, x, w, None)
                outs.append(out)
                time.sleep(2e-4)  # the gap a layer's small ops leave: the worker's time to prefetch
        return outs

    _C.configure_thread_pool(2, home_sections=False, prefetch_kb=0)
    expected = run(3)
    _C.configure_thread_pool(2, home_sections=True, prefetch_kb=64)
    before = _C.thread_pool_info()["prefetched_bytes"]
    got = run(3)
    for _ in range(20):  # a worker the OS did not run in the gaps prefetches nothing: try a few more rounds
        if _C.thread_pool_info()["prefetched_bytes"] > before:
            break
        run(1)
    assert _C.thread_pool_info()["prefetched_bytes"] > before
    for e, o in zip(expected, got):
        assert torch.equal(e, o)
    for x, w, o in zip(xs, ws, got[-4:]):
        torch.testing.assert_close(o.float(), x.float() @ w.float().T, rtol=2e-2, atol=5e-2)


def test_worker_applies_env_and_refuses_bad_values(tiny_llama_dir, monkeypatch, restore_threading):
    monkeypatch.setenv("PAGELLM_NUM_THREADS", "0")
    with pytest.raises(ValueError, match="PAGELLM_NUM_THREADS"):
        LLM(str(tiny_llama_dir), max_model_len=64, seed=0)
    monkeypatch.setenv("PAGELLM_NUM_THREADS", "1")
    monkeypatch.setenv("PAGELLM_BIND", "none")
    llm = LLM(str(tiny_llama_dir), max_model_len=64, seed=0)
    assert _C.thread_pool_info()["num_threads"] == 1 and torch.get_num_threads() == 1
    one = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    _C.configure_thread_pool(2, bind=True)
    two = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert one[0].outputs[0].token_ids == two[0].outputs[0].token_ids


def test_cli_flags_are_checked_and_reach_the_worker_env(capsys):
    from pagellm.entrypoints.cli import build_parser
    from pagellm.threading_config import export_threading_args

    for argv in (["generate", "hi"], ["serve"]):
        args = build_parser().parse_args([*argv, "--num-threads", "1", "--thread-bind", "none"])
        env = {}
        export_threading_args(args, env)
        assert env == {"PAGELLM_NUM_THREADS": "1", "PAGELLM_BIND": "none"}
        env = {"PAGELLM_BIND": "cores"}
        export_threading_args(build_parser().parse_args(argv), env)
        assert env == {"PAGELLM_BIND": "cores"}  # unset flags leave the environment alone
        for bad in ("0", "-2", "x"):
            with pytest.raises(SystemExit):
                build_parser().parse_args([*argv, "--num-threads", bad])
            assert "--num-threads" in capsys.readouterr().err


def test_retain_heap_env_and_type():
    assert ThreadingConfig.from_env({}).retain_heap is True
    assert ThreadingConfig.from_env({"PAGELLM_RETAIN_HEAP": "0"}).retain_heap is False
    with pytest.raises(ValueError, match="PAGELLM_RETAIN_HEAP must be '1'.*'0'"):
        ThreadingConfig.from_env({"PAGELLM_RETAIN_HEAP": "yes"})
    with pytest.raises(TypeError, match="retain_heap must be a bool"):
        ThreadingConfig(retain_heap=1)


_CHURN = """
import resource, sys, torch
from pagellm.threading_config import retain_heap
if sys.argv[1] == "1":
    assert retain_heap()
def churn():  # a step's activations: three blocks of 24 MB at once, then all freed
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        blocks = [torch.ones(24 << 20, dtype=torch.uint8) for _ in range(3)]
        del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
churn()
print(churn())
"""


def test_retain_heap_keeps_freed_blocks_mapped(restore_threading):
    """With glibc's defaults the 72 MB freed at once exceed its (dynamic) trim threshold and go back to the OS,
    so every round faults them in again as new pages; retain_heap keeps them for the next round."""
    import subprocess
    import sys

    def faults(retain: str) -> int:
        out = subprocess.run([sys.executable, "-c", _CHURN, retain], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    pages = 8 * 3 * (24 << 20) // 4096
    default, retained = faults("0"), faults("1")
    assert default > pages // 2, "glibc's defaults should return the blocks (the churn this test is about)"
    assert retained < pages // 50
    info = apply_threading(ThreadingConfig(num_threads=1))
    assert info["retain_heap"] is True
    assert apply_threading(ThreadingConfig(num_threads=1, retain_heap=False))["retain_heap"] is False


def test_pool_profile_names_the_kernel_library(restore_threading):
    """_C.thread_pool_profile: off by default, counts a kernel's regions by body once on, with the library that
    holds the body (what bench_batch_profile --pool-profile hands to addr2line)."""
    assert _C.thread_pool_profile()["enabled"] is False
    _C.configure_thread_pool(2, bind=False)
    x, w = torch.randn(512, 256), torch.rand(256) + 0.5
    _C.set_thread_pool_profiling(True)
    try:
        for _ in range(3):
            torch.ops.pagellm.rms_norm(torch.empty_like(x), x, w, 1e-6)
        prof = _C.thread_pool_profile()
    finally:
        _C.set_thread_pool_profiling(False)
    assert prof["enabled"] is True
    sites = [s for s in prof["sites"] if s["regions"] + s["solo_regions"] > 0]
    assert sum(s["regions"] + s["solo_regions"] for s in sites) == 3
    assert all(s["lib"].endswith(".so") and s["offset"] > 0 for s in sites)
    for s in sites:
        assert s["caller_busy_ns"] <= s["wall_ns"] and s["caller_wait_ns"] <= s["wall_ns"]
