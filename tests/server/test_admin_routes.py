"""Admin routes (admin_routes.py) in front of the real engine with the tiny random Llama: behind the API key,
sleep / wake round trip (completions refused with 503 while asleep, identical after), updating weights from
disk (the completion changes, and comes back after reloading the original), refusals as JSON 400 bodies,
and the routes absent unless enabled."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from .conftest import ServerHandle  # noqa: E402

KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def admin_server(tiny_llama_dir):
    from pagellm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(model=str(tiny_llama_dir), max_model_len=128, num_kv_blocks=256, seed=0)
    h = ServerHandle(engine, model_name="tiny", api_key=KEY, app_kwargs={"enable_admin_routes": True})
    yield h
    h.stop()


@pytest.fixture(scope="module")
def perturbed_dir(tiny_llama_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("admin") / "perturbed"
    shutil.copytree(tiny_llama_dir, dst)
    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    save_file({k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in weights.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _complete(h) -> httpx.Response:
    return httpx.post(f"{h.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "tiny", "prompt": "hello world", "max_tokens": 8, "temperature": 0})


def _text(h) -> str:
    r = _complete(h)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _post(h, path, body=None, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{h.url}{path}", json=body, headers=headers, timeout=60)


def test_routes_need_the_key(admin_server):
    for path in ("/sleep", "/wake_up", "/update_weights_from_disk"):
        r = _post(admin_server, path, {}, headers={})
        assert r.status_code == 401 and "error" in r.json()
    assert httpx.get(f"{admin_server.url}/is_sleeping", timeout=10).status_code == 401


def test_sleep_wake_round_trip(admin_server):
    h = admin_server
    before = _text(h)
    r = _post(h, "/sleep", {"level": 1})
    assert r.status_code == 200, r.text
    assert r.json()["level"] == 1 and r.json()["freed_bytes"] >= 0
    assert httpx.get(f"{h.url}/is_sleeping", headers=AUTH, timeout=10).json() == {"is_sleeping": True}
    r = _complete(h)
    assert r.status_code == 503 and "wake_up" in r.json()["error"]["message"]
    r = _post(h, "/sleep", {"level": 1})  # already asleep
    assert r.status_code == 400 and "asleep" in r.json()["error"]["message"]
    r = _post(h, "/wake_up")
    assert r.status_code == 200 and r.json() == {"is_sleeping": False}
    assert _text(h) == before


@pytest.mark.parametrize("body", [{"level": 3}, {"level": "1"}, {"level": 0}])
def test_bad_sleep_level_is_400(admin_server, body):
    r = _post(admin_server, "/sleep", body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert httpx.get(f"{admin_server.url}/is_sleeping", headers=AUTH, timeout=10).json() == {"is_sleeping": False}


def test_update_weights_from_disk(admin_server, perturbed_dir, tiny_llama_dir):
    h = admin_server
    before = _text(h)
    r = _post(h, "/update_weights_from_disk", {"model_path": str(perturbed_dir)})
    assert r.status_code == 200, r.text
    assert r.json()["num_tensors"] > 0 and r.json()["prefix_cache_reset"] is True
    changed = _text(h)
    r = _post(h, "/update_weights_from_disk", {"model_path": str(tiny_llama_dir)})
    assert r.status_code == 200
    assert _text(h) == before
    assert changed != before


def test_update_refusals_are_400(admin_server, tmp_path):
    h = admin_server
    before = _text(h)
    r = _post(h, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert r.status_code == 400 and "missing" in r.json()["error"]["message"]
    save_file({"model.norm.weight": torch.zeros(3)}, str(tmp_path / "bad.safetensors"))
    r = _post(h, "/update_weights_from_disk", {"model_path": str(tmp_path / "bad.safetensors")})
    assert r.status_code == 400 and "shape" in r.json()["error"]["message"]
    assert _post(h, "/update_weights_from_disk", {}).status_code == 400  # model_path is required
    assert _text(h) == before


def test_admin_routes_off_by_default():
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.entrypoints.openai.api_server import build_app

    from .fake_engine import FakeEngine

    paths = build_app(AsyncLLM(FakeEngine()), "m").openapi()["paths"]
    assert not {"/sleep", "/wake_up", "/is_sleeping", "/update_weights_from_disk"} & set(paths)
