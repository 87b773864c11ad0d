"""The server as lm-eval's `local-completions` sees it: /tokenizer_info + /tokenize + /detokenize read by
lm-eval's own RemoteTokenizer (tokenizer_backend="remote", and its auto-detection), and loglikelihoods
through /v1/completions equal to the offline "pagellm" model type on the same tiny fp32 Llama."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is the optional [eval] extra (pip install 'pagellm[eval]')")
pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")
httpx = pytest.importorskip("httpx")
pytest.importorskip("tenacity", reason="lm-eval's API models (local-completions) need lm-eval[api]")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support  # noqa: E402
from server.conftest import ServerHandle  # noqa: E402 (tests/server/conftest.py)

from pagellm.eval.lm_eval_model import PagellmLM  # noqa: E402

MAX_MODEL_LEN = 128
PAIRS = [("The quick brown fox", " jumps over the lazy dog."), ("Tell me about the sea.", " It is wide"),
         ("Once upon a time", " there was"), ("", "héllo wörld"), ("def main():\n", "    return 42")]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from pagellm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(model=str(tiny_llama_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                        num_kv_blocks=256, seed=0)
    h = ServerHandle(engine, model_name="tiny")
    yield h
    h.stop()


def test_tokenizer_info_is_what_lm_eval_reads(server, tiny_tokenizer):
    info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
    for name in ("eos", "bos", "pad", "unk"):
        assert info[f"{name}_token"] == getattr(tiny_tokenizer, f"{name}_token")
        assert info[f"{name}_token_id"] == getattr(tiny_tokenizer, f"{name}_token_id")
    assert info["chat_template"] == tiny_tokenizer.chat_template
    assert info["model_max_length"] == MAX_MODEL_LEN and info["vocab_size"] == len(tiny_tokenizer)

    assert check_remote_tokenizer_support(server.url + "/v1/completions")
    remote = RemoteTokenizer(server.url + "/v1/completions")
    text = "héllo wörld, the sea 🙂"
    assert remote.encode(text) == tiny_tokenizer.encode(text, add_special_tokens=False)
    assert remote.decode(remote.encode(text)) == text
    assert remote.eos_token_id == tiny_tokenizer.eos_token_id and remote.bos_token_id == tiny_tokenizer.bos_token_id
    chat = [{"role": "user", "content": "Hi"}]
    assert remote.apply_chat_template(chat, bos_token=tiny_tokenizer.bos_token) == tiny_tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)


def test_local_completions_remote_matches_offline_model(server, tiny_llama_dir, tiny_tokenizer):
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    # the empty context's prefix token: TemplateAPI takes `bos_token_id or eos_token_id`, and this BOS is id 0
    # (falsy), so it is named explicitly, as the hf / pagellm model types pick it (BOS when there is one)
    remote = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model="tiny", tokenizer_backend="auto",
                                 max_length=MAX_MODEL_LEN, num_concurrent=1,
                                 custom_prefix_token_id=tiny_tokenizer.bos_token_id)
    assert remote.tokenizer_backend == "remote"  # auto-detected from /tokenizer_info + /tokenize
    offline = PagellmLM(pretrained=str(tiny_llama_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    got_remote = remote.loglikelihood(requests, disable_tqdm=True)
    got_offline = offline.loglikelihood(requests, disable_tqdm=True)
    for (lp_r, greedy_r), (lp_o, greedy_o) in zip(got_remote, got_offline):
        assert math.isclose(lp_r, lp_o, rel_tol=1e-5, abs_tol=1e-5), (got_remote, got_offline)
        assert greedy_r == greedy_o


def _completion(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)


def test_over_long_prompts_400_or_left_truncated(server):
    ids = [(7 * i) % 300 + 5 for i in range(MAX_MODEL_LEN + 20)]
    r = _completion(server, prompt=ids, max_tokens=1)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert str(len(ids)) in err["message"] and str(MAX_MODEL_LEN) in err["message"]  # names the lengths

    # truncate_prompt_tokens=k: exactly the request with the last k ids (echo shows the kept prompt)
    scored = _completion(server, prompt=ids, max_tokens=0, echo=True, logprobs=1, truncate_prompt_tokens=50).json()
    direct = _completion(server, prompt=ids[-50:], max_tokens=0, echo=True, logprobs=1).json()
    assert scored["choices"][0]["logprobs"] == direct["choices"][0]["logprobs"]
    assert scored["usage"]["prompt_tokens"] == 50

    # -1: as many as fit next to max_tokens; text prompts and chat too (under the 8 characters per token cap)
    r = _completion(server, prompt="the sea is wide " * 50, max_tokens=20, temperature=0, truncate_prompt_tokens=-1)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 20
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "tell me about the sea " * 40}], "max_tokens": 4,
        "truncate_prompt_tokens": 30}).json()
    assert chat["usage"]["prompt_tokens"] == 30
    r = _completion(server, prompt=ids, max_tokens=1, truncate_prompt_tokens=0)
    assert r.status_code == 400 and "truncate_prompt_tokens" in r.json()["error"]["message"]


def test_lm_eval_generation_over_the_server_context(server, tiny_tokenizer):
    """lm-eval's default max_length (2048) is over this server's 128: with truncate_prompt_tokens=-1 in the
    task's gen_kwargs (lm-eval sends them in the payload) a long context is left-truncated, not refused.
    (Its remote tokenizer sends whole contexts to /tokenize; this one is also under /v1/completions' cap of
    8 characters per token of max_model_len, and far over 128 tokens.)"""
    remote = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model="tiny", tokenizer_backend="remote",
                                 max_gen_toks=8, num_concurrent=1)
    context = "Count: " + " ".join(str(i) for i in range(150))
    assert len(context) <= 8 * MAX_MODEL_LEN and len(tiny_tokenizer.encode(context)) > 2 * MAX_MODEL_LEN
    gen_kwargs = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False, "truncate_prompt_tokens": -1}
    (text,) = remote.generate_until([Instance("generate_until", {}, (context, gen_kwargs), 0)], disable_tqdm=True)
    kept = tiny_tokenizer.encode(context, add_special_tokens=False)[-(MAX_MODEL_LEN - 8):]
    direct = _completion(server, prompt=kept, max_tokens=8, temperature=0, stop=["\n\n", "</s>"]).json()
    assert text == direct["choices"][0]["text"]


def test_perplexity_of_a_long_document_over_the_server(server, tiny_llama_dir, tiny_tokenizer):
    """lm-eval reads no length from the server (0.4.13: TemplateAPI's max_length model arg, default 2048), so
    its default flow needs `max_length=<max_model_len>`; with it, loglikelihood_rolling of a document far
    longer than the context (its remote tokenizer sends the whole text to /tokenize, over the 8 characters per
    token cap of /v1/completions) equals the offline model type's windows."""
    document = " ".join(f"Line {i}: the sea is wide, the sky is blue." for i in range(40))
    assert len(document) > 8 * MAX_MODEL_LEN and len(tiny_tokenizer.encode(document)) > 3 * MAX_MODEL_LEN
    remote = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model="tiny", tokenizer_backend="auto",
                                 max_length=MAX_MODEL_LEN, num_concurrent=1,
                                 custom_prefix_token_id=tiny_tokenizer.bos_token_id)
    offline = PagellmLM(pretrained=str(tiny_llama_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    request = [Instance("loglikelihood_rolling", {}, (document,), 0)]
    (got_remote,) = remote.loglikelihood_rolling(request, disable_tqdm=True)
    (got_offline,) = offline.loglikelihood_rolling(request, disable_tqdm=True)
    assert math.isclose(got_remote, got_offline, rel_tol=1e-5, abs_tol=1e-4), (got_remote, got_offline)

    # without max_length the harness sends windows of up to 2047 tokens: a clean 400 naming max_model_len
    ids = tiny_tokenizer.encode(document, add_special_tokens=False)[:2047]
    r = _completion(server, prompt=ids, max_tokens=1, echo=True, logprobs=1)
    assert r.status_code == 400 and str(MAX_MODEL_LEN) in r.json()["error"]["message"]
