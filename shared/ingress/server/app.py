"""The FastAPI app: middleware, error rendering, health routes, and every dialect's router.

`create_app(state)` is the one place routers are mounted: the three dialects
(shared/ingress/dialects/), named caches and the session API. A router
reads the shared `IngressState` from `request.app.state.ingress` and raises
`ApiError`; the handlers here render it in the route's dialect. Every
response (errors included) carries `x-request-id` on OpenAI routes and
`request-id` on Anthropic ones. A well-formed `x-session-id` is bound to logs at once; a generation route
rebinds the session it resolves (shared/ingress/sessions/tracker.py).

The public port serves the API, /healthz, /readyz and, to API-key holders,
the OpenAPI document (/openapi.json, shared/ingress/server/openapi.py). Metrics are
not here: the service runner's side port (`service.http_port`) serves them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from kvmesh.ingress.core.errors import ApiError, Dialect, ErrorKind, dialect_of
from kvmesh.ingress.core.state import IngressState
from kvmesh.ingress.core.types import GatewayError
from kvmesh.ingress.dialects.anthropic import routes as anthropic_routes
from kvmesh.ingress.dialects.openai import routes as openai_routes
from kvmesh.ingress.dialects.responses import routes as responses_routes
from kvmesh.ingress.named_caches import api as named_caches
from kvmesh.ingress.server.openapi import build_openapi
from kvmesh.ingress.sessions import api as session_api
from kvmesh.log import bind_request, get_logger
from kvmesh.sessions.identity import MAX_ID_CHARS
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = get_logger(__name__)

# Routers of other parts, mounted if their module is present: (module, attribute).
_ROUTERS = (openai_routes.router, anthropic_routes.router, responses_routes.router, named_caches.router,
            session_api.router)


class RequestIdMiddleware:
    """Pure ASGI (streams pass through untouched): assigns the request id, binds it, stamps the header.

    Also counts every response by route and status (`count`); unknown paths count as one label.
    """

    def __init__(self, app: ASGIApp, count: Callable[[str, int], None], routes: list[BaseRoute]) -> None:
        self.app, self.count, self.routes = app, count, routes

    def label(self, scope: Scope) -> str:
        """The route template (`/v1/caches/{cache_id}`), a bounded label; `other` for unknown paths."""
        for route in self.routes:
            if route.matches(scope)[0] is Match.FULL:
                return getattr(route, "path", "other")
        return "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = "req_" + uuid.uuid4().hex
        # latin-1, as HTTP defines header bytes: a value that is not UTF-8 must not fail the request here
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        client_session = _session_id(headers.get("x-session-id", ""))
        scope.setdefault("state", {})
        scope["state"]["request_id"] = request_id
        header = b"request-id" if dialect_of(scope.get("path", "")) is Dialect.ANTHROPIC else b"x-request-id"

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.count(self.label(scope), message["status"])
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (header, request_id.encode())]
            await send(message)

        with bind_request(request_id, client_session):
            await self.app(scope, receive, stamped)


def _session_id(raw: str) -> str | None:
    """The client's session id for early logs, if well formed (the route rejects a malformed one)."""
    raw = raw.strip()
    return raw if 0 < len(raw) <= MAX_ID_CHARS and raw.isprintable() else None


def error_response(exc: ApiError, path: str) -> JSONResponse:
    dialect = dialect_of(path)
    return JSONResponse(exc.body(dialect), status_code=exc.status(dialect), headers=exc.headers())


def gateway_api_error(exc: GatewayError) -> ApiError:
    """A retriable overload tells the client when to come back (Retry-After), as a rate limit does."""
    retry = 1.0 if exc.kind is ErrorKind.OVERLOADED and exc.retriable else None
    return ApiError(exc.kind, exc.message, retry_after_s=retry)


def _cache(app: FastAPI) -> dict:
    app.openapi_schema = build_openapi(app)
    return app.openapi_schema


def create_app(state: IngressState) -> FastAPI:
    """The ingress app over `state`."""
    app = FastAPI(title="kvmesh", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ingress = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return error_response(gateway_api_error(exc), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(ErrorKind.INVALID_REQUEST, str(exc.errors()[:1])), request.url.path)

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        return error_response(ApiError(ErrorKind.NOT_FOUND, f"no route {request.url.path}"), request.url.path)

    @app.exception_handler(405)
    async def _bad_method(request: Request, exc: Exception) -> JSONResponse:
        error = ApiError(ErrorKind.INVALID_REQUEST, f"{request.method} is not allowed on {request.url.path}")
        return error_response(error, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", path=request.url.path)
        return error_response(ApiError(ErrorKind.API, "internal error"), request.url.path)

    @app.get("/healthz")
    async def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/readyz")
    async def readyz() -> Response:
        ready = state.gateway.ready()
        return PlainTextResponse("ready" if ready else "not ready", status_code=200 if ready else 503)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        state.keyring.authenticate(request)  # the document tells what this server runs: key holders only
        return JSONResponse(app.openapi())

    routes = [r for r in app.routes if isinstance(r, BaseRoute)]
    for router in _ROUTERS:
        app.include_router(router)
        routes += router.routes
    named_caches.install(state)  # sets state.cache_lookup
    app.openapi = lambda: app.openapi_schema or _cache(app)  # type: ignore[method-assign]
    app.add_middleware(RequestIdMiddleware, routes=routes,
                       count=lambda route, status: state.metrics.requests.labels(route, str(status)).inc())
    return app
