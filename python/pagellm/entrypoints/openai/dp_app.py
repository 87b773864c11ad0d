"""The front server of data-parallel serving: one OpenAI-compatible endpoint in front of N replica servers
(each a plain `pagellm serve` on 127.0.0.1, entrypoints/dp_serve.py starts them).

    app = build_dp_app(replicas, make_router("least_loaded", len(replicas)), api_key=None)

`replicas[i]` has `.url` ("http://127.0.0.1:PORT") and `.dead_reason()` (None while it can serve, else why
not: "replica 1 (pid 123) exited with code -9"). Every route but /health and /metrics is proxied to the
replica the router picks (requests are never sent to a replica known dead): the body and the response pass
through unchanged, a stream chunk by chunk; a client that disconnects closes the upstream connection, which
aborts the replica's request. /health: 503 while draining or when any replica is dead (naming it).
/metrics: each replica's samples labelled replica="i", plus the front's own pagellm_dp_* figures.
The front checks the API key (replicas get the same key; the client's header is passed on).
Errors: a replica that cannot be reached or dies mid-request -> 502 (503 when it is known dead) JSON body,
or, once a stream has started, a final SSE error event and `data: [DONE]`; no live replica -> 503.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.entrypoints.openai.api_server import HEALTH_PATH, METRICS_PATH
from pagellm.entrypoints.openai.drain import DrainMiddleware, ServerDrain
from pagellm.entrypoints.openai.dp_router import LeastLoadedRouter
from pagellm.entrypoints.openai.errors import error_response, install_error_handlers
from pagellm.entrypoints.openai.input_checks import DEFAULT_MAX_REQUEST_BYTES
from pagellm.entrypoints.openai.metrics import CONTENT_TYPE
from pagellm.entrypoints.openai.middleware import AuthMiddleware, RequestSizeLimitMiddleware
from pagellm.entrypoints.openai.serving_base import SSE_DONE, error_body, sse
from pagellm.logger import init_logger

logger = init_logger(__name__)

# hop-by-hop and length headers are the proxy's own business on each side
_DROP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})
_STATUS_TIMEOUT_S = 5.0


def _unavailable(status: int, message: str) -> JSONResponse:
    return error_response(status, message, "ServiceUnavailableError", code=status)


class ReplicaProxy:
    """Forwards requests to the replicas; owns the HTTP client and the router's in-flight counts."""

    def __init__(self, replicas: list, router: LeastLoadedRouter, api_key: str | None) -> None:
        if router.num_replicas != len(replicas):
            raise ValueError(f"the router has {router.num_replicas} replicas, {len(replicas)} were given")
        self.replicas = replicas
        self.router = router
        self.auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        # no read timeout: a long generation streams for as long as it takes; the replica's death ends it
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=_STATUS_TIMEOUT_S),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def alive(self) -> list[bool]:
        return [r.dead_reason() is None for r in self.replicas]

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None  # the replica answers the 400
        i = self.router.pick(parsed, self.alive())
        if i is None:
            return _unavailable(503, "no replica is serving: " + "; ".join(r.dead_reason() or "" for r in self.replicas))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS}
        url = self.replicas[i].url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        self.router.started(i)
        try:
            upstream = await self.client.send(self.client.build_request(request.method, url, headers=headers,
                                                                        content=body), stream=True)
        except httpx.HTTPError as e:
            self.router.finished(i)
            return self._failed(i, e)
        is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_HEADERS}
        return StreamingResponse(self._relay(i, upstream, is_sse), status_code=upstream.status_code,
                                 headers=out_headers)

    async def _relay(self, i: int, upstream: httpx.Response, is_sse: bool):
        """The upstream body chunk by chunk; cancelled (client gone) or not, the upstream connection is
        closed at the end and the replica's count released."""
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            reason = self.replicas[i].dead_reason() or f"replica {i} failed mid-response: {type(e).__name__}"
            logger.warning("%s", reason)
            if is_sse:  # the status line is out: tell the client in the stream, as the replicas do
                yield sse(error_body(reason, "ServiceUnavailableError", None, 502)).encode()
                yield SSE_DONE.encode()
        finally:
            self.router.finished(i)
            await upstream.aclose()

    def _failed(self, i: int, e: Exception) -> JSONResponse:
        dead = self.replicas[i].dead_reason()
        if dead is not None:
            return _unavailable(503, dead)
        return _unavailable(502, f"replica {i} could not be reached: {type(e).__name__}: {e}")

    async def replica_get(self, i: int, path: str) -> httpx.Response | None:
        """GET a replica's status route; None when it cannot be reached."""
        if self.replicas[i].dead_reason() is not None:
            return None
        try:
            return await self.client.get(self.replicas[i].url + path, headers=self.auth, timeout=_STATUS_TIMEOUT_S)
        except httpx.HTTPError:
            return None


def build_dp_app(replicas: list, router: LeastLoadedRouter, api_key: str | None = None, *,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, metrics_require_auth: bool = False) -> FastAPI:
    """The front app; `app.state.drain` is its ServerDrain (GracefulServer drains it on SIGTERM) and
    `app.state.proxy` its ReplicaProxy."""
    proxy = ReplicaProxy(replicas, router, api_key)
    drain = ServerDrain()
    app = FastAPI(title="pagellm data-parallel front")
    app.state.proxy = proxy
    app.state.drain = drain
    install_error_handlers(app)
    _add_status_routes(app, proxy, drain)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT"], include_in_schema=False)
    async def forward(request: Request):
        return await proxy.forward(request)

    app.add_middleware(RequestSizeLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        open_paths = {HEALTH_PATH} if metrics_require_auth else {HEALTH_PATH, METRICS_PATH}
        app.add_middleware(AuthMiddleware, api_key=api_key, open_paths=frozenset(open_paths))
    app.add_middleware(DrainMiddleware, drain=drain, open_paths=frozenset({HEALTH_PATH, METRICS_PATH}))
    return app


def _add_status_routes(app: FastAPI, proxy: ReplicaProxy, drain: ServerDrain) -> None:
    @app.get(HEALTH_PATH, include_in_schema=False)
    async def health():
        if drain.draining:
            return JSONResponse({"status": "draining", "message": "the server is shutting down"}, 503,
                                headers={"Retry-After": str(drain.retry_after_s)})
        answers = await asyncio.gather(*(proxy.replica_get(i, HEALTH_PATH) for i in range(len(proxy.replicas))))
        states, problems = [], []
        for i, (replica, r) in enumerate(zip(proxy.replicas, answers)):
            ok = r is not None and r.status_code == 200
            states.append({"replica": i, "status": "ok" if ok else "dead"})
            if not ok:
                problems.append(replica.dead_reason() or f"replica {i} is not healthy: "
                                + (r.text[:200] if r is not None else "no answer"))
        if problems:
            return JSONResponse({"status": "dead", "message": "; ".join(problems), "replicas": states}, 503)
        return JSONResponse({"status": "ok", "replicas": states})

    @app.get(METRICS_PATH, include_in_schema=False)
    async def metrics():
        answers = await asyncio.gather(*(proxy.replica_get(i, METRICS_PATH) for i in range(len(proxy.replicas))))
        texts = [r.text if r is not None and r.status_code == 200 else None for r in answers]
        return Response(merge_metrics(texts) + front_metrics(proxy), media_type=CONTENT_TYPE)


def _labelled(sample: str, replica: int) -> str:
    """`name{a="b"} 1` -> `name{replica="i",a="b"} 1`; `name 1` -> `name{replica="i"} 1`."""
    name_end = min((p for p in (sample.find("{"), sample.find(" ")) if p >= 0), default=len(sample))
    name, rest = sample[:name_end], sample[name_end:]
    if rest.startswith("{"):
        return f'{name}{{replica="{replica}",{rest[1:]}' if rest[1:2] != "}" else f'{name}{{replica="{replica}"{rest[1:]}'
    return f'{name}{{replica="{replica}"}}{rest}'


def merge_metrics(texts: list[str | None]) -> str:
    """The replicas' Prometheus texts as one: each family once (its HELP / TYPE from the first replica that
    has it), its samples from every replica with a replica="i" label. None: a replica that did not answer."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for i, text in enumerate(texts):
        current = None
        for line in (text or "").splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split()[2]
                if name not in families:
                    families[name] = ([], [])
                current = families[name]
                if not any(h.split()[:3] == line.split()[:3] for h in current[0]):
                    current[0].append(line)
            elif line and not line.startswith("#"):
                if current is None:
                    current = families.setdefault("", ([], []))
                current[1].append(_labelled(line, i))
    return "".join("\n".join(head + samples) + "\n" for head, samples in families.values())


def front_metrics(proxy: ReplicaProxy) -> str:
    """The front's own figures: which replicas are up, and its routing counts."""
    alive = proxy.alive()
    rows = [("pagellm_dp_replica_up", "gauge", "1 while the replica process is running", lambda i: int(alive[i])),
            ("pagellm_dp_requests_in_flight", "gauge", "requests the front has in flight on the replica",
             lambda i: proxy.router.in_flight[i]),
            ("pagellm_dp_requests_routed_total", "counter", "requests the front has sent to the replica",
             lambda i: proxy.router.routed[i])]
    out = []
    for name, kind, help_text, value in rows:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        out += [f'{name}{{replica="{i}"}} {value(i)}' for i in range(len(proxy.replicas))]
    return "\n".join(out) + "\n"
