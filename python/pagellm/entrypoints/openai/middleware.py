"""Pure ASGI middleware of the server (no BaseHTTPMiddleware: it would buffer nothing here, but it runs each
request in an extra task group and hides disconnects from streaming handlers).

    RequestSizeLimitMiddleware   413 for a body over max_bytes: Content-Length checked before the app runs,
                                 then the bytes received counted, so an oversized body is never read whole
    AuthMiddleware               401 without 'Authorization: Bearer <key>' on every path but the open ones

Both answer with the OpenAI-style JSON error body (serving_base.error_body).
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.openai.serving_base import error_body


def route_path(scope: Scope) -> str:
    """The request's path without the app's root_path (routes are matched on this)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class RequestTooLarge(HTTPException):
    """Raised from `receive` once the body passes the limit (FastAPI re-raises HTTPExceptions from body
    reading, so the app's 413 handler answers)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, too_large_message(max_bytes))


def too_large_message(max_bytes: int) -> str:
    return f"Request body too large: the limit is {max_bytes} bytes (--max-request-bytes)."


def too_large_response(max_bytes: int) -> JSONResponse:
    return JSONResponse(error_body(too_large_message(max_bytes), "RequestTooLargeError", None, "request_too_large"),
                        status_code=413)


class RequestSizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await too_large_response(self.max_bytes)(scope, receive, send)  # the body is never read
            return
        received = 0
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)
            return message

        async def watching_send(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except RequestTooLarge:
            if response_started:  # read by a handler after it answered: nothing left to tell
                raise
            await too_large_response(self.max_bytes)(scope, receive, send)


class AuthMiddleware:
    """Every path needs the bearer token except `open_paths` (matched exactly, after root_path)."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = frozenset()) -> None:
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope) not in self.open_paths:
            got = Headers(scope=scope).get("authorization", "").encode("latin-1", "replace")
            if not hmac.compare_digest(got, self.expected):
                body = error_body("Invalid or missing API key (expected 'Authorization: Bearer <key>').",
                                  "AuthenticationError", None, "invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
