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
                             chunks_per_thread=saved["chunks_per_thread"], max_backoff_ms=saved["max_backoff_ms"])
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
               {"num_threads": 1, "chunks_per_thread": 0}, {"num_threads": 1, "max_backoff_ms": -1}):
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


@pytest.mark.parametrize("num_threads,bind,chunks", [(1, True, 4), (2, True, 1), (2, False, 4), (8, False, 64)])
def test_kernels_agree_with_the_reference_at_every_pool_setting(restore_threading, num_threads, bind, chunks):
    _C.configure_thread_pool(num_threads, bind=bind, chunks_per_thread=chunks)
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
