"""The server's exception handlers: every error is answered with the OpenAI-style JSON body
{"error": {"message", "type", "param", "code"}}, quoting at most a short prefix of the client's input.

    400 BadRequestError        malformed JSON, wrong field types, out-of-range values, invalid Unicode,
                               prompt too long, empty messages, unsupported options
    401 AuthenticationError    missing / wrong bearer token (middleware.AuthMiddleware)
    404 NotFoundError          unknown path or model name
    405 MethodNotAllowedError  with an Allow header
    413 RequestTooLargeError   body over --max-request-bytes (middleware.RequestSizeLimitMiddleware)
    429 RateLimitError         more than max_queue_len requests waiting for a batch slot (Retry-After)
    503 ServiceUnavailableError  the engine loop died, the engine is asleep (admin_routes.py), or the server
                                 is shutting down (drain.py)
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.engine.async_llm import EngineDeadError, QueueFullError
from pagellm.engine.maintenance import EngineSleepingError
from pagellm.entrypoints.openai.input_checks import quote_input
from pagellm.entrypoints.openai.serving_base import OpenAIError, error_body
from pagellm.inputs import PromptTooLongError
from pagellm.logger import init_logger

logger = init_logger(__name__)

_HTTP_ERROR_TYPES = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError"}


def error_response(status: int, message: str, type: str = "BadRequestError", param=None, code=None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def _loc_text(loc) -> str:
    """A field location; a key longer than 30 chars (a client's dict key) is quoted short."""
    return ".".join(str(x) if len(str(x)) <= 30 else quote_input(x, 30) for x in loc if x != "body")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of a request that failed validation; never quotes the offending input itself."""
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    if e.get("type") == "json_invalid":
        return f"Invalid JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    param = _loc_text(e.get("loc", ())) or None
    msg = "; ".join(f"{loc}: {er.get('msg')}" if (loc := _loc_text(er.get("loc", ()))) else str(er.get("msg"))
                    for er in errs[:5])
    return msg, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(_req, exc: RequestValidationError):
        msg, param = validation_message(exc)
        return error_response(400, msg, "BadRequestError", param)

    @app.exception_handler(OpenAIError)
    async def _on_openai_error(_req, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(QueueFullError)
    async def _on_queue_full(_req, exc: QueueFullError):
        return error_response(429, str(exc), "RateLimitError", None, "queue_full", headers={"Retry-After": "1"})

    @app.exception_handler(PromptTooLongError)
    async def _on_too_long(_req, exc: PromptTooLongError):
        return error_response(400, str(exc), "BadRequestError", "prompt", "context_length_exceeded")

    @app.exception_handler(ValueError)
    async def _on_value_error(_req, exc: ValueError):
        return error_response(400, str(exc), "BadRequestError")

    @app.exception_handler(EngineDeadError)
    async def _on_dead(_req, exc: EngineDeadError):
        return error_response(503, str(exc), "ServiceUnavailableError", code=503)

    @app.exception_handler(EngineSleepingError)
    async def _on_sleeping(_req, exc: EngineSleepingError):
        return error_response(503, str(exc), "ServiceUnavailableError", code=503)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_req, exc: StarletteHTTPException):
        status = exc.status_code
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
        return error_response(status, str(exc.detail or phrase), _HTTP_ERROR_TYPES.get(status, "invalid_request_error"),
                              code="request_too_large" if status == 413 else None,
                              headers=exc.headers)  # 405 carries Allow

    @app.exception_handler(Exception)
    async def _on_any(_req, exc: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"{type(exc).__name__}: {exc}", "InternalServerError", code=500)
