"""/metrics reports the KV-cache bytes per token of the served model (pagellm:kv_cache_bytes_per_token)."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from .conftest import ServerHandle  # noqa: E402


def test_metrics_report_kv_cache_bytes_per_token(tiny_llama_dir):
    from pagellm.engine.llm_engine import LLMEngine

    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    # K and V rows of every layer, float32 cache
    expected = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4
    engine = LLMEngine.from_engine_args(model=str(tiny_llama_dir), max_model_len=128, num_kv_blocks=64, seed=0)
    h = ServerHandle(engine, model_name="tiny")
    try:  # one request: the engine thread has taken a stats snapshot by the time it is answered
        r = httpx.post(h.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        text = httpx.get(h.url + "/metrics").text
    finally:
        h.stop()
    lines = [x for x in text.splitlines() if x.startswith("pagellm:kv_cache_bytes_per_token{")]
    assert lines == [f'pagellm:kv_cache_bytes_per_token{{model_name="tiny"}} {float(expected)}']


def test_metrics_without_the_figure_leave_the_gauge_unset():
    from pagellm.engine.stats import EngineStats
    from pagellm.entrypoints.openai.metrics import ServerMetrics

    text = ServerMetrics("m").render(EngineStats()).decode()
    assert "# TYPE pagellm:kv_cache_bytes_per_token gauge" in text
    assert "pagellm:kv_cache_bytes_per_token{" not in text
