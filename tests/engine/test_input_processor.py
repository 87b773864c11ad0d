"""The one input processor (pagellm.inputs): every prompt form gives the tokenizer's ids, every bad
input is refused before any state changes (engine, scheduler, LLM batch, AsyncLLM), and LLM.chat and
the server's chat route render and tokenize a conversation identically. Tiny random-weight Llama and
byte-level BPE tokenizer from tests/conftest.py; references: the HF tokenizer itself."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from pagellm import SamplingParams
from pagellm.inputs import InputProcessor, PromptTooLongError, apply_chat_template, chat_prompt

MAX_MODEL_LEN = 64
TEXT = "The sea is wide"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Tell me about the sea"}]


def _forms_and_texts(text: str, ids: list[int]) -> list[tuple]:
    """Every accepted prompt form for the same prompt, with the prompt text the processor keeps."""
    return [(text, text), ({"prompt": text}, text), ({"prompt": text, "add_special_tokens": True}, text),
            (ids, None), (tuple(ids), None), (np.asarray(ids), None), (torch.tensor(ids), None),
            ({"prompt_token_ids": ids}, None), ({"prompt_token_ids": ids, "prompt": text}, text)]


def _forms(text: str, ids: list[int]) -> list:
    return [form for form, _ in _forms_and_texts(text, ids)]


@pytest.fixture(scope="module")
def processor(tiny_tokenizer):
    return InputProcessor(tiny_tokenizer, len(tiny_tokenizer), MAX_MODEL_LEN,
                          eos_token_ids=[tiny_tokenizer.eos_token_id])


def _bad_inputs(vocab: int) -> list[tuple]:
    """(prompt, params, exception type, message pattern)."""
    ok = {"prompt_token_ids": [5, 6, 7]}
    nan_temperature = SamplingParams()
    nan_temperature.temperature = math.nan  # mutated after construction
    return [
        ("", None, ValueError, "empty"),
        ({"prompt_token_ids": []}, None, ValueError, "empty"),
        ([], None, ValueError, "empty"),
        ({"prompt_token_ids": [5, vocab]}, None, ValueError, "vocabulary"),
        ({"prompt_token_ids": [5, -1]}, None, ValueError, "vocabulary"),
        ({"prompt_token_ids": [5, 6.0]}, None, TypeError, "ints"),
        ({"prompt_token_ids": [5, "6"]}, None, TypeError, "ints"),
        ({"prompt_token_ids": [5, True]}, None, TypeError, "ints"),
        ({"prompt_token_ids": "5 6"}, None, TypeError, "list of ints"),
        ([5] * MAX_MODEL_LEN, None, PromptTooLongError, "shorter than max_model_len=64"),
        ([5] * (MAX_MODEL_LEN - 4), SamplingParams(max_tokens=10), PromptTooLongError, r"lower max_tokens to <= 4"),
        (42, None, TypeError, "prompt must be"),
        (["a", "b"], None, TypeError, "ints"),
        ({"text": "hi"}, None, TypeError, "'prompt' or 'prompt_token_ids'"),
        ({"prompt": 5}, None, TypeError, "must be a str"),
        (ok, nan_temperature, ValueError, "temperature"),
        (ok, SamplingParams(logit_bias={vocab: 1.0}), ValueError, "logit_bias"),
        (ok, {"max_tokens": 3}, TypeError, "SamplingParams"),
        ([5] * (MAX_MODEL_LEN - 4), SamplingParams(max_tokens=None, min_tokens=10), ValueError, "min_tokens"),
    ]


# ---------------------------------------------------------------------------- the processor alone
def test_every_form_gives_the_tokenizers_ids(processor, tiny_tokenizer):
    ref = tiny_tokenizer(TEXT)["input_ids"]
    for form, text in _forms_and_texts(TEXT, ref):
        req = processor.process(form)
        assert req.prompt_token_ids == ref and all(type(t) is int for t in req.prompt_token_ids), form
        assert req.prompt == text, form
    no_special = processor.process({"prompt": TEXT, "add_special_tokens": False}).prompt_token_ids
    assert no_special == tiny_tokenizer(TEXT, add_special_tokens=False)["input_ids"]


def test_params_are_a_completed_clone(processor, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    sp = SamplingParams(max_tokens=None, stop_token_ids=[7])
    req = processor.process([5, 6, 7], sp)
    assert req.params is not sp and sp.max_tokens is None and sp.all_stop_token_ids == {7}
    assert req.params.max_tokens == MAX_MODEL_LEN - 3 and req.params.all_stop_token_ids == {7, eos}
    kept = processor.process([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True)).params
    assert kept.max_tokens == 5 and kept.all_stop_token_ids == set() and kept.eos_token_ids == {eos}
    assert processor.process([5] * (MAX_MODEL_LEN - 1), SamplingParams(max_tokens=None)).params.max_tokens == 1
    # processing a processed request again changes nothing (front ends hand the engine token ids)
    again = processor.process(req.as_prompt(), req.params)
    assert again.prompt_token_ids == req.prompt_token_ids and again.params == req.params


def test_bad_inputs_raise(processor, tiny_tokenizer):
    for prompt, params, exc, match in _bad_inputs(len(tiny_tokenizer)):
        with pytest.raises(exc, match=match):
            processor.process(prompt, params)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        InputProcessor(None, 100, 16).process("hi")
    with pytest.raises(ValueError, match="vocab_size"):
        InputProcessor(None, 0, 16)


def test_chat_template_and_chatml_fallback(tiny_tokenizer):
    ref = tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert apply_chat_template(tiny_tokenizer, MESSAGES) == ref
    assert chat_prompt(tiny_tokenizer, MESSAGES) == {"prompt": ref, "add_special_tokens": False}

    class NoTemplate:  # a tokenizer without a chat template gets ChatML
        chat_template = None

    assert apply_chat_template(NoTemplate(), MESSAGES) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nTell me about the sea<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert apply_chat_template(NoTemplate(), MESSAGES, continue_final_message=True).endswith("about the sea")
    with pytest.raises(ValueError, match="non-empty"):
        apply_chat_template(tiny_tokenizer, [])
    with pytest.raises(TypeError, match="list of"):
        apply_chat_template(tiny_tokenizer, "hi")


# ---------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")
    from pagellm import LLM

    return LLM(str(tiny_llama_dir), max_model_len=MAX_MODEL_LEN, seed=0)


def _assert_engine_idle(eng, num_prompt_tokens: int) -> None:
    assert not eng.has_unfinished_requests() and not eng.output_processor.requests
    assert eng.scheduler.num_waiting == 0 and eng.scheduler.num_running == 0
    assert eng.num_prompt_tokens_total == num_prompt_tokens


def test_engine_uses_one_processor(llm):
    eng = llm.llm_engine
    assert llm.input_processor is eng.input_processor
    assert eng.input_processor.max_model_len == MAX_MODEL_LEN and eng.input_processor.vocab_size == eng.vocab_size


def test_every_form_generates_the_same(llm, tiny_tokenizer):
    ref = tiny_tokenizer(TEXT)["input_ids"]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    forms_and_texts = _forms_and_texts(TEXT, ref)
    outs = llm.generate([form for form, _ in forms_and_texts], greedy, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ref] * len(outs)
    assert [o.prompt for o in outs] == [text for _, text in forms_and_texts]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert llm.generate(ref, greedy, use_tqdm=False)[0].prompt_token_ids == ref  # a flat id list is one prompt


def test_bad_inputs_change_no_engine_state(llm, tiny_tokenizer):
    eng = llm.llm_engine
    before = eng.num_prompt_tokens_total
    for i, (prompt, params, exc, match) in enumerate(_bad_inputs(len(tiny_tokenizer))):
        with pytest.raises(exc, match=match):
            eng.add_request(f"bad-{i}", prompt, params)
        _assert_engine_idle(eng, before)
        eng.add_request(f"bad-{i}", [5, 6], SamplingParams(max_tokens=1))  # the id was never taken
        eng.abort_request(f"bad-{i}")
        before += 2
    with pytest.raises(ValueError, match="empty"):  # one bad prompt in a batch: nothing is queued
        llm.generate(["fine", {"prompt_token_ids": [5]}, ""], SamplingParams(max_tokens=2), use_tqdm=False)
    _assert_engine_idle(eng, before)


def test_async_llm_refuses_before_the_engine(llm, tiny_tokenizer):
    from pagellm.engine.async_llm import AsyncLLM

    eng = llm.llm_engine
    ref = tiny_tokenizer(TEXT)["input_ids"]
    before = eng.num_prompt_tokens_total
    front = AsyncLLM(eng)
    assert front.input_processor is eng.input_processor

    async def main():
        ids = [(await front.process_inputs(form)).prompt_token_ids for form in _forms(TEXT, ref)]
        assert ids == [ref] * len(ids)
        for prompt, params, exc, match in _bad_inputs(len(tiny_tokenizer)):
            with pytest.raises(exc, match=match):
                await front.add_request("bad", prompt, params)
            assert front.get_num_unfinished_requests() == 0 and not front._pending_adds
        processed = await front.process_inputs(TEXT, SamplingParams(max_tokens=2))
        with pytest.raises(TypeError, match="carries its own"):
            await front.add_request("twice", processed, SamplingParams())
        outs = [o async for o in front.generate(processed, None, "good")]
        assert outs[-1].finished and outs[-1].prompt_token_ids == ref

    try:
        asyncio.run(main())
    finally:
        front.shutdown()
    _assert_engine_idle(eng, before + len(ref))


# ---------------------------------------------------------------------------- chat: LLM vs the server
@pytest.mark.parametrize("continue_final", [False, True])
def test_chat_same_ids_in_llm_and_server(llm, tiny_tokenizer, continue_final):
    pytest.importorskip("fastapi", reason="the server path needs the [server] extra")
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat

    msgs = MESSAGES + ([{"role": "assistant", "content": "The sea"}] if continue_final else [])
    text = tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=not continue_final,
                                              continue_final_message=continue_final)
    ref = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    offline = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False,
                       add_generation_prompt=not continue_final, continue_final_message=continue_final)[0]
    assert offline.prompt_token_ids == ref and offline.prompt == text
    assert llm.apply_chat_template(msgs, add_generation_prompt=not continue_final,
                                   continue_final_message=continue_final) == ref

    front = AsyncLLM(llm.llm_engine)
    serving = OpenAIServingChat(front, ["tiny"], None)
    req = ChatCompletionRequest(messages=msgs, max_tokens=2, temperature=0.0,
                                add_generation_prompt=not continue_final, continue_final_message=continue_final)
    try:
        served = asyncio.run(serving.process_chat(req))
    finally:
        front.shutdown()
    assert served.prompt_token_ids == ref and served.prompt == text
    assert served.params.max_tokens == 2 and served.params.eos_token_ids == {tiny_tokenizer.eos_token_id}
