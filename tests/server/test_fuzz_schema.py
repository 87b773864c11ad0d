"""Schema-based fuzzing: schemathesis generates requests from the app's own OpenAPI schema (valid ones,
and for bodies invalid ones too) and sends them to the server in front of the fake engine, in this
process. Every answer must be no 5xx, a documented status code and content type, a body matching the
documented schema, and for invalid data a 4xx. Examples are bounded (a few hundred in all) and derandomized,
so a run takes well under a minute and a failure reproduces."""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="the fuzz test needs `pip install -e .[test]`")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,  # noqa: E402
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

from pagellm.engine.async_llm import AsyncLLM  # noqa: E402
from pagellm.entrypoints.openai.api_server import build_app  # noqa: E402

from .conftest import ServerHandle, wait_blocks_free  # noqa: E402
from .fake_engine import FakeEngine  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, negative_data_rejection]
# Examples per (operation, mode): generation routes get the most; an operation without parameters has one.
EXAMPLES = {("/v1/completions", "positive"): 120, ("/v1/completions", "negative"): 80,
            ("/v1/chat/completions", "positive"): 120, ("/v1/chat/completions", "negative"): 80}
DEFAULT_EXAMPLES = 50


def _engine() -> FakeEngine:
    # A short context bounds every generation (n up to 128 x max_tokens < 96): no example takes long. 96, not
    # less: the chat template alone takes ~46 tokens, and at 32 only 3 of 120 chat examples fitted, so a run
    # that drew none (the example set varies with the random state earlier tests leave) failed the 200 check.
    return FakeEngine(max_model_len=96, max_num_seqs=256, step_time=0)


def _operations() -> list[tuple[str, str, str]]:
    """(path, method, mode) for every operation the app documents: a new route is fuzzed without edits here."""
    schema = build_app(AsyncLLM(_engine()), "test-model").openapi()
    cases = []
    for path, item in schema["paths"].items():
        for method, op in item.items():
            has_input = "requestBody" in op or op.get("parameters")
            for mode in ("positive", "negative") if has_input else ("positive",):
                cases.append((path, method, mode))
    return cases


@pytest.fixture(scope="module")
def fuzz_server():
    h = ServerHandle(_engine(), max_queue_len=100_000)
    h.schema = schemathesis.openapi.from_dict(h.app.openapi())
    yield h
    h.stop()


@pytest.mark.parametrize("path,method,mode", _operations())
def test_fuzz_operation_against_its_schema(fuzz_server, path, method, mode):
    operation = fuzz_server.schema[path][method.upper()]
    has_input = mode == "negative" or "requestBody" in operation.definition.raw
    num_examples = EXAMPLES.get((path, mode), DEFAULT_EXAMPLES) if has_input else 1
    sent = []

    @settings(max_examples=num_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(GenerationMode(mode)))
    def fuzz(case):
        response = case.call_and_validate(base_url=fuzz_server.url, timeout=30, checks=CHECKS)
        sent.append(response.status_code)
        if response.status_code >= 400 and len(refusals) < 5:
            refusals.append(response.text[:300])

    refusals: list[str] = []
    fuzz()
    assert sent and all(code < 500 for code in sent)
    if mode == "positive" and path in ("/v1/completions", "/v1/chat/completions"):
        # the generator reached the engine, not only the validators
        assert 200 in sent, f"status codes {sent}; first refusals: {refusals}"


def test_server_is_sound_after_fuzzing(fuzz_server):
    """Whatever the fuzzer sent, nothing is left running and every KV block is free."""
    h = fuzz_server
    assert wait_blocks_free(h.engine, 20), (h.engine.num_free_blocks, h.engine.num_total_blocks)
    r = httpx.post(h.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
