"""`pagellm serve --max-logprobs N --logprobs-mode MODE` (vLLM's names) reach the engine: the flags parsed by the
serve parser, the engine built from serve.engine_kwargs, and the server's answers checked against it."""

from __future__ import annotations

import argparse
import math

import pytest

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")
httpx = pytest.importorskip("httpx")

from server.conftest import ServerHandle  # noqa: E402 (tests/server/conftest.py)

from pagellm.entrypoints import serve  # noqa: E402
from pagellm.sampling_params import LOGPROBS_MODES  # noqa: E402


def _parse(argv: list[str]) -> argparse.Namespace:
    return serve.add_serve_args(argparse.ArgumentParser()).parse_args(argv)


def test_flags_parse_into_engine_kwargs():
    kwargs = serve.engine_kwargs(_parse(["--max-logprobs", "-1", "--logprobs-mode", "processed_logits"]))
    assert kwargs["max_logprobs"] == -1 and kwargs["logprobs_mode"] == "processed_logits"
    assert "max_logprobs" not in serve.engine_kwargs(_parse([]))  # unset: the engine's defaults (20, raw_logprobs)
    assert "logprobs_mode" not in serve.engine_kwargs(_parse([]))
    for bad in (["--max-logprobs", "-2"], ["--max-logprobs", "x"], ["--logprobs-mode", "logits"]):
        with pytest.raises(SystemExit):
            _parse(bad)
    text = " ".join(serve.add_serve_args(argparse.ArgumentParser()).format_help().split())
    assert "--max-logprobs" in text and all(mode in text for mode in LOGPROBS_MODES)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from pagellm.engine.llm_engine import LLMEngine

    args = _parse([str(tiny_llama_dir), "--max-logprobs", "3", "--logprobs-mode", "raw_logits",
                   "--max-model-len", "64", "--num-kv-blocks", "64", "--seed", "0"])
    engine = LLMEngine.from_engine_args(model=args.model, **serve.engine_kwargs(args))
    assert engine.max_logprobs == 3 and engine.logprobs_mode == "raw_logits"
    h = ServerHandle(engine, model_name="tiny")
    yield h
    h.stop()


PROMPT_IDS = (5, 9, 13, 21)
MAX_TOKENS = 3


def _complete(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": list(PROMPT_IDS), "max_tokens": MAX_TOKENS, "temperature": 0, **body})


def test_max_logprobs_caps_requests(server):
    r = _complete(server, logprobs=4)
    assert r.status_code == 400 and "max_logprobs=3" in r.json()["error"]["message"]
    r = _complete(server, logprobs=3)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"]) == MAX_TOKENS


def test_logprobs_mode_is_the_servers_default(server, tiny_llama_dir):
    """raw_logits: each generated token's reported value is its logit, as HF transformers computes it over the
    same fp32 weights (greedy, so the tokens are HF's argmax too)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), torch_dtype=torch.float32).eval()
    ids, want = list(PROMPT_IDS), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
            want.append(float(logits[ids[-1]]))
    got = _complete(server, logprobs=1).json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(got) == MAX_TOKENS and any(v > 0 for v in got)  # logits, not log-probabilities (all <= 0)
    for g, w in zip(got, want):
        assert math.isclose(g, w, rel_tol=1e-4, abs_tol=1e-4), (got, want)
