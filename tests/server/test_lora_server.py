"""LoRA adapters behind the OpenAI server: `model` = an adapter's name routes the request to it (output equal
to offline LLM.generate with that adapter), /v1/models lists the adapters, an unknown model is a 404 JSON error;
plus the CLI's --lora-modules parsing."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import httpx
import pytest

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from .conftest import ServerHandle  # noqa: E402

_spec = importlib.util.spec_from_file_location("lora_helpers", Path(__file__).parents[1] / "engine" / "lora_helpers.py")
lora_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lora_helpers)

PROMPT = "The quick brown fox"
ENGINE_KW = dict(max_model_len=128, num_kv_blocks=128, seed=0, enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return lora_helpers.write_peft_adapter(tmp_path_factory.mktemp("sql"), tiny_llama_dir, rank=8, alpha=16,
                                           targets=lora_helpers.ALL_TARGETS, seed=11)


@pytest.fixture(scope="module")
def lora_server(tiny_llama_dir, adapter_dir):
    from pagellm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(model=str(tiny_llama_dir), **ENGINE_KW)
    engine.add_lora("sql", str(adapter_dir))
    h = ServerHandle(engine, model_name="tiny", app_kwargs={"enable_admin_routes": True})
    yield h
    h.stop()


def _offline_texts(tiny_llama_dir, adapter_dir) -> dict[str, str]:
    from pagellm import LLM, LoRARequest, SamplingParams

    llm = LLM(str(tiny_llama_dir), **ENGINE_KW)
    llm.load_lora("sql", str(adapter_dir))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    base, sql = (llm.generate(PROMPT, params, use_tqdm=False, lora_request=lr)[0].outputs[0].text
                 for lr in (None, LoRARequest("sql", 1)))
    return {"tiny": base, "sql": sql}


def test_model_name_routes_to_the_adapter(lora_server, tiny_llama_dir, adapter_dir):
    expected = _offline_texts(tiny_llama_dir, adapter_dir)
    assert expected["tiny"] != expected["sql"]
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=lora_server.url, timeout=60) as c:
        for model in ("sql", "tiny", "sql"):
            r = c.post("/v1/completions", json={**body, "model": model})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected[model]
            assert r.json()["model"] == model  # the response names the adapter (or the base model) asked for
        chat = c.post("/v1/chat/completions", json={"model": "sql", "max_tokens": 4, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["model"] == "sql"
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert ids == ["tiny", "sql"]


def test_unknown_model_is_a_404(lora_server):
    with httpx.Client(base_url=lora_server.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"model": "nope", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and "nope" in err["message"]
        assert c.post("/v1/completions", json={"model": "sql", "prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_load_and_unload_adapters_at_run_time(lora_server, adapter_dir, tmp_path):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=lora_server.url, timeout=60) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": str(adapter_dir)})
        assert r.status_code == 200, r.text
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "sql", "sql2"]
        texts = [c.post("/v1/completions", json={**body, "model": m}).json()["choices"][0]["text"]
                 for m in ("sql", "sql2")]
        assert texts[0] == texts[1]
        for bad in ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, {"lora_name": "tiny", "lora_path": "/a"}):
            r = c.post("/v1/load_lora_adapter", json=bad)
            assert r.status_code == 400 and "error" in r.json()
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "sql2"}).status_code == 200
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "sql2"}).status_code == 400
        assert c.post("/v1/completions", json={**body, "model": "sql2"}).status_code == 404
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "sql"]


def test_cli_lora_options():
    from pagellm.lora.cli_args import add_lora_args, lora_engine_kwargs

    p = argparse.ArgumentParser()
    add_lora_args(p)
    a = p.parse_args(["--lora-modules", "sql=/a", "chat=/b", "--max-loras", "3", "--max-lora-rank", "32"])
    assert a.lora_modules == [("sql", "/a"), ("chat", "/b")]
    assert lora_engine_kwargs(a) == {"max_loras": 3, "max_lora_rank": 32, "enable_lora": True}
    assert lora_engine_kwargs(p.parse_args([])) == {}
    with pytest.raises(SystemExit):
        p.parse_args(["--lora-modules", "no-equals-sign"])
