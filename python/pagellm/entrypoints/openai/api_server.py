"""The OpenAI-compatible HTTP server: a FastAPI app in front of an AsyncLLM.

    app = build_app(async_llm, "SmolLM2-135M-Instruct", api_key=None, max_queue_len=256)

`pagellm serve` (entrypoints/serve.py) builds the AsyncLLM, calls build_app and runs uvicorn; this
module never imports it back.

Every route but /health and /metrics needs the API key when one is set (/metrics too with
metrics_require_auth). A body over max_request_bytes is refused (413) while it is read. Every request
is validated before its response starts: a stream that answered 200 only ends early with an error event
for a failure inside the engine, or for a shutdown (drain.py). Errors: see errors.py.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.engine.async_llm import AsyncLLM, EngineDeadError
from pagellm.entrypoints.openai.admin_routes import admin_router
from pagellm.entrypoints.openai.drain import DrainMiddleware, ServerDrain
from pagellm.entrypoints.openai.errors import install_error_handlers
from pagellm.entrypoints.openai.input_checks import DEFAULT_MAX_REQUEST_BYTES
from pagellm.entrypoints.openai.lora_routes import lora_router
from pagellm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagellm.entrypoints.openai.middleware import AuthMiddleware, RequestSizeLimitMiddleware
from pagellm.entrypoints.openai.openapi import responses, schema_without_422
from pagellm.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                                 CompletionResponse, DetokenizeRequest, DetokenizeResponse,
                                                 HealthResponse, ModelCard, ModelList, TokenizeChatRequest,
                                                 TokenizeCompletionRequest, TokenizeResponse, VersionResponse)
from pagellm.entrypoints.openai.serving_base import OpenAIError, lora_names
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.tokenizer_routes import tokenizer_router

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
HEALTH_PATH, METRICS_PATH = "/health", "/metrics"


async def engine_dead_reason(llm: AsyncLLM) -> str | None:
    """Why the engine cannot serve (its loop died or was shut down), or None when it can."""
    dead = getattr(llm, "dead_error", None)  # AsyncLLM's "engine loop died" report, where it has one
    if dead is not None:
        return str(dead)
    try:
        await llm.check_health()
    except EngineDeadError as e:
        return str(e)
    return None


def _json_or_stream(result) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers=_SSE_HEADERS)


def build_app(async_llm: AsyncLLM, served_model_name: str | list[str], api_key: str | None = None,
              max_queue_len: int | None = None, root_path: str = "", *,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, metrics_require_auth: bool = False,
              enable_admin_routes: bool = False) -> FastAPI:
    """The app; `app.state.drain` is its ServerDrain (a SIGTERM handler awaits `drain.drain(timeout_s)`).
    `enable_admin_routes`: also /update_weights_from_disk, /sleep, /wake_up, /is_sleeping (admin_routes.py)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if max_queue_len is not None:
        async_llm.max_queue_len = max_queue_len
    metrics = ServerMetrics(names[0])
    drain = ServerDrain()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # The engine is owned by whoever built the AsyncLLM (`pagellm serve` shuts it down).

    app = FastAPI(title="pagellm OpenAI-compatible server", lifespan=lifespan, root_path=root_path)
    app.state.async_llm = async_llm
    app.state.metrics = metrics
    app.state.served_model_names = names
    app.state.drain = drain
    install_error_handlers(app)
    _add_status_routes(app, async_llm, names, metrics, drain, metrics_auth=bool(api_key and metrics_require_auth))
    _add_model_routes(app, async_llm, names, metrics)
    app.include_router(tokenizer_router(async_llm))  # GET /tokenizer_info (lm-eval's remote tokenizer)
    if enable_admin_routes:
        app.include_router(admin_router(async_llm))
        if getattr(getattr(async_llm, "engine", None), "lora", None) is not None:  # LoRA on: adapter routes too
            app.include_router(lora_router(async_llm, names))
    app.openapi = schema_without_422(app)

    # add_middleware wraps what is there: the last added runs first. Drain (refuse while shutting down,
    # count what is in flight) -> auth -> body size -> the routes.
    app.add_middleware(RequestSizeLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        open_paths = {HEALTH_PATH} if metrics_require_auth else {HEALTH_PATH, METRICS_PATH}
        app.add_middleware(AuthMiddleware, api_key=api_key, open_paths=frozenset(open_paths))
    app.add_middleware(DrainMiddleware, drain=drain, open_paths=frozenset({HEALTH_PATH, METRICS_PATH}))
    return app


def _add_status_routes(app: FastAPI, async_llm: AsyncLLM, names: list[str], metrics: ServerMetrics,
                       drain: ServerDrain, metrics_auth: bool) -> None:
    @app.get(HEALTH_PATH, response_model=None, responses={
        200: {"model": HealthResponse, "description": "Serving"},
        503: {"model": HealthResponse, "description": "Draining for shutdown, or the engine loop is dead"}})
    async def health():
        if drain.draining:
            return JSONResponse({"status": "draining", "message": "the server is shutting down"}, 503,
                                headers={"Retry-After": str(drain.retry_after_s)})
        reason = await engine_dead_reason(async_llm)
        if reason is not None:
            return JSONResponse({"status": "dead", "message": reason}, 503)
        return JSONResponse({"status": "ok"})

    @app.get(METRICS_PATH, response_model=None, responses=responses(None, auth=metrics_auth, media_type=CONTENT_TYPE))
    async def get_metrics():
        return Response(metrics.render(async_llm.get_stats()), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=None, responses=responses(ModelList))
    async def models():
        cards = [ModelCard(id=n, root=names[0], max_model_len=async_llm.max_model_len)
                 for n in names + lora_names(async_llm)]  # LoRA adapters: their own model names
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/version", response_model=None, responses=responses(VersionResponse))
    async def version():
        from pagellm.version import __version__

        return JSONResponse({"version": __version__})


def _add_model_routes(app: FastAPI, async_llm: AsyncLLM, names: list[str], metrics: ServerMetrics) -> None:
    completion = OpenAIServingCompletion(async_llm, names, metrics)
    chat = OpenAIServingChat(async_llm, names, metrics)

    @app.post("/v1/completions", response_model=None,
              responses=responses(CompletionResponse, 400, 404, 413, 429, stream=True))
    async def create_completion(req: CompletionRequest, raw_request: Request):
        return _json_or_stream(await completion.create_completion(req, raw_request))

    @app.post("/v1/chat/completions", response_model=None,
              responses=responses(ChatCompletionResponse, 400, 404, 413, 429, stream=True))
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request):
        return _json_or_stream(await chat.create_chat_completion(req, raw_request))

    @app.post("/tokenize", response_model=None, responses=responses(TokenizeResponse, 400, 404, 413))
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest):
        completion.check_model(req.model)
        await async_llm.check_health()  # its tokenizer thread is gone with the engine (503)
        if isinstance(req, TokenizeChatRequest):
            prompt = {**await chat.render_prompt(req, tokenize_only=True), "add_special_tokens": req.add_special_tokens}
        else:
            completion.check_prompt_chars(len(req.prompt), tokenize_only=True)  # only tokenized: a larger cap
            prompt = {"prompt": req.prompt, "add_special_tokens": req.add_special_tokens}
        _, ids = await async_llm.run_in_tokenizer_thread(async_llm.input_processor.tokenize, prompt)
        return JSONResponse({"count": len(ids), "max_model_len": async_llm.max_model_len, "tokens": ids})

    @app.post("/detokenize", response_model=None, responses=responses(DetokenizeResponse, 400, 404, 413))
    async def detokenize(req: DetokenizeRequest):
        completion.check_model(req.model)
        await async_llm.check_health()
        vocab_size = async_llm.input_processor.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(f"token id {bad[0]} is not in the vocabulary (ids 0..{vocab_size - 1})", param="tokens")
        try:
            text = await async_llm.run_in_tokenizer_thread(async_llm.tokenizer.decode, req.tokens)
        except Exception as e:  # noqa: BLE001 - whatever the tokenizer refuses is the client's input
            raise OpenAIError(f"cannot decode tokens: {e}", param="tokens") from e
        return JSONResponse({"prompt": text})
