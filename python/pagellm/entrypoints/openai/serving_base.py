"""What completions and chat share: model check, admission of a request's processed prompts, token
texts, merging per-prompt output streams, disconnect watching, SSE framing, OpenAI-style errors.
Prompts are checked at the edge first (length in characters, logit_bias ids: cheap refusals before the
tokenizer runs), then tokenized and checked by the engine's InputProcessor (AsyncLLM.process_inputs),
all before a response (or stream) starts."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, AsyncIterator

from fastapi import Request

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.input_checks import prompt_chars_message, quote_input, safe_message
from pagellm.entrypoints.openai.metrics import ServerMetrics
from pagellm.inputs import ProcessedRequest
from pagellm.lora.request import LoRARequest
from pagellm.sampling_params import SamplingParams


class OpenAIError(Exception):
    """An error answered with an OpenAI-style JSON body."""

    def __init__(self, message: str, status_code: int = 400, type: str = "BadRequestError",
                 param: str | None = None, code: str | int | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "BadRequestError", param: str | None = None, code=None) -> dict:
    """The OpenAI-style error object; message and param are cut short and made UTF-8-safe (they may
    quote client input, which must never make the answer huge or unencodable)."""
    return {"error": {"message": safe_message(str(message)), "type": type,
                      "param": None if param is None else safe_message(str(param), 200), "code": code}}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"

MIN_LOGPROB = -9999.0  # stands for -inf (and NaN), which JSON cannot carry; vLLM reports the same


def finite_logprob(x: float) -> float:
    return x if math.isfinite(x) else (0.0 if x > 0 else MIN_LOGPROB)


async def merge_async_iterators(*iterators: AsyncIterator) -> AsyncIterator[tuple[int, Any]]:
    """Yield (i, item) from several async iterators as items arrive; closing this closes them all."""
    if len(iterators) == 1:
        it = iterators[0]
        try:
            async for item in it:
                yield 0, item
        finally:
            await it.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, it):
        try:
            async for item in it:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for it in iterators:
            await it.aclose()


async def run_until_disconnect(coro, raw_request: Request | None, poll_s: float = 0.25):
    """Run coro; cancel it (which aborts its engine requests) if the HTTP client goes away."""
    task = asyncio.ensure_future(coro)
    if raw_request is None:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await raw_request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise OpenAIError("client disconnected", 499, "ClientDisconnected")
    finally:
        if not task.done():
            task.cancel()


def lora_names(llm: AsyncLLM) -> list[str]:
    """The LoRA adapters the engine has loaded (served under their own names as `model`)."""
    list_loras = getattr(getattr(llm, "engine", None), "list_loras", None)
    return list_loras() if callable(list_loras) else []


class ServingBase:
    def __init__(self, llm: AsyncLLM, served_model_names: list[str], metrics: ServerMetrics | None) -> None:
        self.llm = llm
        self.served_model_names = served_model_names
        self.metrics = metrics
        self._tok_text_cache: dict[int, str] = {}

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def response_model(self, model: str | None) -> str:
        """The `model` a response names: the adapter's name for a LoRA request, else the served model's."""
        return model if self.lora_request(model) is not None else self.model_name

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names and model not in lora_names(self.llm):
            raise OpenAIError(f"The model {quote_input(model)} does not exist.", 404, "NotFoundError", "model",
                              "model_not_found")

    def check_prompt_chars(self, num_chars: int, param: str = "prompt", tokenize_only: bool = False) -> None:
        """Refuse a prompt too long to fit before anything tokenizes it (400); tokenize_only: /tokenize's
        larger cap (input_checks.max_tokenize_chars)."""
        message = prompt_chars_message(num_chars, self.llm.max_model_len, param, tokenize_only)
        if message is not None:
            raise OpenAIError(message, param=param, code="context_length_exceeded")

    @staticmethod
    def sampling_params(req) -> SamplingParams:
        """The request's SamplingParams; whatever their validation refuses is a 400."""
        try:
            return req.to_sampling_params()
        except (TypeError, ValueError) as e:
            raise OpenAIError(str(e)) from e

    def check_logit_bias(self, params: SamplingParams) -> None:
        vocab_size = self.llm.input_processor.vocab_size
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(f"logit_bias token id {bad[0]} is not in the vocabulary (ids 0..{vocab_size - 1})",
                              param="logit_bias")

    async def process_prompt(self, prompt, params: SamplingParams) -> ProcessedRequest:
        """One prompt through the edge checks and the input processor; any refusal is a 400, raised before
        anything is admitted. EngineDeadError (503) first if the engine cannot serve any more."""
        await self.llm.check_health()  # else a stopped AsyncLLM's tokenizer thread would fail it as a 500
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt))
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str) and "prompt_token_ids" not in prompt:
            self.check_prompt_chars(len(prompt["prompt"]), "messages")
        self.check_logit_bias(params)
        try:
            return await self.llm.process_inputs(prompt, params)
        except TypeError as e:  # the input processor's "wrong prompt form": the client's mistake
            raise OpenAIError(str(e), param="prompt") from e

    def token_text(self, token_id: int, lp=None) -> str:
        if lp is not None and getattr(lp, "decoded_token", None) is not None:
            return lp.decoded_token
        t = self._tok_text_cache.get(token_id)
        if t is None:
            try:
                t = self.tokenizer.decode([token_id], skip_special_tokens=False)
            except TypeError:
                t = self.tokenizer.decode([token_id])
            if len(self._tok_text_cache) < 200_000:
                self._tok_text_cache[token_id] = t
        return t

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The LoRARequest of a `model` naming a loaded adapter (None for the base model's names)."""
        if model is None or model in self.served_model_names or model not in lora_names(self.llm):
            return None
        return LoRARequest(model, self.llm.engine.lora.adapters[model].int_id)

    async def admit(self, request_id: str, processed: list[ProcessedRequest], priority: int = 0,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    ) -> tuple[list[AsyncIterator], list[str]]:
        """Admit every processed prompt of a request (all or none); return their output iterators and ids."""
        extra = {} if lora_request is None else {"lora_request": lora_request}
        gens: list[AsyncIterator] = []
        ids = []
        try:
            for i, req in enumerate(processed):
                rid = request_id if len(processed) == 1 else f"{request_id}-{i}"
                gens.append(await self.llm.submit(req, None, rid, priority=priority, arrival_time=arrival_time, **extra))
                ids.append(rid)
        except BaseException:
            await self.llm.abort(ids)
            for g in gens:
                await g.aclose()
            raise
        return gens, ids
