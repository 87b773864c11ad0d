"""The app's OpenAPI schema as the server behaves: validation errors are 400 with the OpenAI error body
(FastAPI's default 422 + HTTPValidationError is never answered, so it is removed everywhere), each route
documents the error statuses it can answer, and streaming routes document text/event-stream.

    @app.post("/v1/completions", responses=responses(CompletionResponse, 400, 404, 413, 429, stream=True))
    app.openapi = schema_without_422(app)
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagellm.entrypoints.openai.protocol import ErrorResponse

_ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a field of the wrong type or out of range, invalid Unicode, "
         "a prompt too long for the model, or an unsupported option",
    401: "Missing or wrong API key (when the server has one)",
    404: "Unknown model",
    413: "Request body larger than --max-request-bytes",
    429: "Too many requests waiting for a batch slot (Retry-After)",
    503: "The engine stopped, or the server is shutting down (Retry-After)",
}
_ALWAYS = (401, 503)  # every route behind the key can answer these (auth; shutdown drain)


_SSE_EVENT = {
    "type": "object",
    "description": "One server-sent event: `data` is a chunk's JSON, an error object if the request fails midway, "
                   "or `[DONE]` at the end",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}},
    "required": ["data"],
}


def responses(model=None, *error_codes: int, stream: bool = False, auth: bool = True,
              media_type: str | None = None) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=`: 200 with `model` (or a plain-text `media_type`), SSE when `stream`, and the
    OpenAI error body for each error code (plus 401 and 503 unless auth=False)."""
    ok: dict[str, Any] = {"description": "Successful response"}
    if model is not None:
        ok["model"] = model
    content = {}
    if media_type is not None:
        content[media_type] = {"schema": {"type": "string"}}
    if stream:
        # Before OpenAPI 3.2 (no `itemSchema`), an event stream's `schema` describes one event.
        content["text/event-stream"] = {"schema": _SSE_EVENT}
    if content:
        ok["content"] = content
    out: dict[int | str, dict[str, Any]] = {200: ok}
    codes = sorted(set(error_codes) | (set(_ALWAYS) if auth else set()))
    for code in codes:
        out[code] = {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[code]}
    return out


def _strip_422(schema: dict) -> dict:
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            if isinstance(operation, dict):
                operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema


def schema_without_422(app: FastAPI) -> Callable[[], dict]:
    """A replacement for `app.openapi`: FastAPI's schema, built once, with the 422s removed."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _strip_422(get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes))
        return app.openapi_schema

    return openapi
