"""The HTTP side server of a service: /healthz, /readyz, /metrics.

Runs uvicorn inside the service's event loop on an already-bound socket (so
port 0 works and the real port is known before anyone is told about it),
with uvicorn's own signal handling off: the runner owns SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from kvmesh.metrics import ServiceMetrics

ReadyCheck = Callable[[], dict[str, bool]]  # named conditions; ready when all are true


def build_app(ready: ReadyCheck, metrics: ServiceMetrics) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}  # the process and its event loop answer

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        checks = ready()
        ok = all(checks.values())
        return JSONResponse({"ready": ok, "checks": checks}, status_code=200 if ok else 503)

    @app.get("/metrics")
    def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(content=body, media_type=content_type)

    return app


class _EmbeddedServer(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the runner handles signals; uvicorn must not re-raise them after shutdown


class SideServer:
    """Start with `await start()` (returns the endpoint URL), stop with `await stop()`."""

    def __init__(self, host: str, port: int, ready: ReadyCheck, metrics: ServiceMetrics) -> None:
        self._host, self._port = host, port
        config = uvicorn.Config(build_app(ready, metrics), log_config=None, access_log=False, lifespan="off")
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None
        self.endpoint = ""

    async def start(self) -> str:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the startup error
                raise RuntimeError("HTTP side server exited during startup")
            await asyncio.sleep(0.01)
        host = f"[{self._host}]" if family == socket.AF_INET6 else self._host
        self.endpoint = f"http://{host}:{port}"
        return self.endpoint

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._task = None
