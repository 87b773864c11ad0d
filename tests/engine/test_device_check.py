"""device="cuda" where it cannot run: a ValueError naming why, raised before the model is loaded."""

from __future__ import annotations

import pytest
import torch

from pagellm.engine.device_check import check_device_usable


def test_cpu_is_always_usable():
    check_device_usable(torch.device("cpu"))


def test_cpu_only_torch_is_named(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match="CPU-only"):
        check_device_usable(torch.device("cuda"))


def test_no_visible_gpu_is_named(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        check_device_usable(torch.device("cuda:0"))


def test_index_past_the_count_is_named(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="only 1 CUDA device"):
        check_device_usable(torch.device("cuda:3"))


def test_build_without_cuda_kernels_is_named(monkeypatch):
    from pagellm import _C

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(_C, "built_with_cuda", False)
    with pytest.raises(ValueError, match="built without CUDA kernels"):
        check_device_usable(torch.device("cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a usable GPU")
def test_llm_refuses_before_loading(tiny_llama_dir):
    from pagellm import LLM

    with pytest.raises(ValueError, match="device='cuda'"):
        LLM(str(tiny_llama_dir), device="cuda")


def test_weights_that_do_not_fit_are_named_with_numbers(monkeypatch):
    from pagellm.engine.device_check import weights_do_not_fit

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 << 29, 80 << 30))
    err = weights_do_not_fit(torch.device("cuda:0"), torch.bfloat16,
                             torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"))
    assert isinstance(err, ValueError)
    assert "1.50 GiB of 80.00 GiB free" in str(err) and "Tried to allocate 2.00 GiB" in str(err)
    assert "torch.bfloat16" in str(err)
