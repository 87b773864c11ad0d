"""The OpenAI-compatible HTTP server: a FastAPI app in front of an AsyncLLM.

    app = build_app(async_llm, "SmolLM2-135M-Instruct", api_key=None, max_queue_len=256)

`pagellm serve` (entrypoints/serve.py) builds the AsyncLLM, calls build_app and runs uvicorn; this
module never imports it back.

Errors are OpenAI-style JSON: {"error": {"message", "type", "param", "code"}}:
    400 BadRequestError   malformed JSON, wrong field types, out-of-range values, prompt too long,
                          empty messages, unsupported options
    401 AuthenticationError  missing / wrong bearer token on /v1/* (when an API key is set)
    404 NotFoundError     unknown model name (as OpenAI answers)
    429 RateLimitError    more than max_queue_len requests waiting for a batch slot
    503 ServiceUnavailableError  the engine loop died (also /health)
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from pagellm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagellm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                 ModelCard, ModelList, TokenizeChatRequest,
                                                 TokenizeCompletionRequest)
from pagellm.entrypoints.openai.serving_base import OpenAIError, error_body
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.inputs import PromptTooLongError
from pagellm.logger import init_logger

logger = init_logger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _err(status: int, message: str, type: str = "BadRequestError", param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    if e.get("type") == "json_invalid":
        return f"Invalid JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body') or 'body'}: {er.get('msg')}"
                    for er in errs[:5])
    return msg, param


def build_app(async_llm: AsyncLLM, served_model_name: str | list[str], api_key: str | None = None,
              max_queue_len: int | None = None, root_path: str = "") -> FastAPI:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if max_queue_len is not None:
        async_llm.max_queue_len = max_queue_len
    metrics = ServerMetrics(names[0])
    completion = OpenAIServingCompletion(async_llm, names, metrics)
    chat = OpenAIServingChat(async_llm, names, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # The engine is owned by whoever built the AsyncLLM (`pagellm serve` shuts it down).

    app = FastAPI(title="pagellm OpenAI-compatible server", lifespan=lifespan, root_path=root_path)
    app.state.async_llm = async_llm
    app.state.metrics = metrics
    app.state.served_model_names = names

    # ---------------------------------------------------------------- errors
    @app.exception_handler(RequestValidationError)
    async def _on_validation(_req, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return _err(400, msg, "BadRequestError", param)

    @app.exception_handler(OpenAIError)
    async def _on_openai_error(_req, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(QueueFullError)
    async def _on_queue_full(_req, exc: QueueFullError):
        return JSONResponse(error_body(str(exc), "RateLimitError", None, "queue_full"), status_code=429,
                            headers={"Retry-After": "1"})

    @app.exception_handler(PromptTooLongError)
    async def _on_too_long(_req, exc: PromptTooLongError):
        return _err(400, str(exc), "BadRequestError", "prompt", "context_length_exceeded")

    @app.exception_handler(ValueError)
    async def _on_value_error(_req, exc: ValueError):
        return _err(400, str(exc), "BadRequestError")

    @app.exception_handler(EngineDeadError)
    async def _on_dead(_req, exc: EngineDeadError):
        return _err(503, str(exc), "ServiceUnavailableError", code=503)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_req, exc: StarletteHTTPException):
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else ""
        return _err(exc.status_code, str(exc.detail or phrase), "NotFoundError" if exc.status_code == 404
                    else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _on_any(_req, exc: Exception):
        logger.exception("unhandled error")
        return _err(500, f"{type(exc).__name__}: {exc}", "InternalServerError", code=500)

    # ---------------------------------------------------------------- auth
    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if request.method != "OPTIONS" and request.url.path.startswith(f"{root_path}/v1"):
                got = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(got, expected):
                    return _err(401, "Invalid or missing API key (expected 'Authorization: Bearer <key>').",
                                "AuthenticationError", code="invalid_api_key")
            return await call_next(request)

    # ---------------------------------------------------------------- routes
    @app.get("/health")
    async def health():
        try:
            await async_llm.check_health()
        except EngineDeadError as e:
            return _err(503, str(e), "ServiceUnavailableError", code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(async_llm.get_stats()), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        cards = [ModelCard(id=n, root=names[0], max_model_len=async_llm.max_model_len) for n in names]
        return ModelList(data=cards).model_dump()

    @app.get("/version")
    async def version():
        from pagellm.version import __version__

        return {"version": __version__}

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw_request: Request):
        result = await completion.create_completion(req, raw_request)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream", headers=_SSE_HEADERS)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request):
        result = await chat.create_chat_completion(req, raw_request)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream", headers=_SSE_HEADERS)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest):
        completion.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            prompt = {**await chat.render_prompt(req), "add_special_tokens": req.add_special_tokens}
        else:
            prompt = {"prompt": req.prompt, "add_special_tokens": req.add_special_tokens}
        _, ids = await async_llm.run_in_tokenizer_thread(async_llm.input_processor.tokenize, prompt)
        return {"count": len(ids), "max_model_len": async_llm.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        completion.check_model(req.model)
        vocab = getattr(async_llm.tokenizer, "vocab_size", None)
        try:
            text = async_llm.tokenizer.decode(req.tokens)
        except Exception as e:
            raise OpenAIError(f"cannot decode tokens: {e}", param="tokens") from e
        if vocab and any(t < 0 or t >= vocab + 1024 for t in req.tokens):
            raise OpenAIError("token id out of range", param="tokens")
        return {"prompt": text}

    return app
