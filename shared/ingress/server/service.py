"""Wiring of the ingress process: runner context -> IngressState -> FastAPI app on uvicorn.

`setup(ctx)` is the runner's setup hook (see shared/service/runner.py): it
loads the tokenizer and model config from `KVMESH_MODEL_DIR`, the API keys,
starts following worker heartbeats, and serves the app on
`ingress.host:ingress.port` until the runner drains (SIGTERM), when uvicorn
stops taking connections and finishes open responses first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from kvmesh.config import Settings
from kvmesh.engine.checkpoint_error import CheckpointError
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.ingress.admission.auth import KeyRing
from kvmesh.ingress.admission.limits import RateLimiter
from kvmesh.ingress.admission.salt_secret import load_secret
from kvmesh.ingress.core.metrics import IngressMetrics
from kvmesh.ingress.core.prompt import PromptBuilder
from kvmesh.ingress.core.state import IngressState
from kvmesh.ingress.routing.prefix_locator import PrefixLocator, model_fingerprint
from kvmesh.ingress.routing.workers import WorkerTable
from kvmesh.ingress.server.app import create_app
from kvmesh.ingress.sessions.table import SessionTable
from kvmesh.ingress.sessions.tracker import ChainHasher, SessionTracker
from kvmesh.ingress.sessions.traffic import TrafficRecorder
from kvmesh.ingress.supervision.gateway import Gateway
from kvmesh.log import get_logger
from kvmesh.protocol.vllm_identity import model_fingerprint as vllm_fingerprint
from kvmesh.service.runner import ServiceContext
from kvmesh.toolcalls.formats import select

log = get_logger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the service runner owns SIGTERM/SIGINT and drains."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def model_limits(model_dir: Path) -> tuple[int, list[int]]:
    """The context length and eos ids from config.json (the ingress does not load the weights)."""
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else [int(e) for e in eos or []]
    return int(config.get("max_position_embeddings", 2048)), eos_ids


def build_state(settings: Settings, gateway: Gateway, tokenizer: Tokenizer, metrics: IngressMetrics,
                model_dir: Path, secret: bytes) -> IngressState:
    """The routes' shared state. Sessions hash chains as the workers do when the locator knows the model's
    fingerprint; without it they still infer sessions, but their events name no blocks."""
    s = settings.ingress
    block_size = settings.engine.block_size
    fingerprint = gateway.locator.fingerprint if gateway.locator is not None else None
    sessions = SessionTracker(SessionTable(block_size), ChainHasher(block_size, fingerprint), metrics,
                              gateway.publisher)
    keyring = KeyRing.from_settings(settings.api_keys, s.keys_file, settings.state_dir, secret)
    context_len, eos_ids = model_limits(model_dir)
    if not len(keyring):
        log.warning("no API keys configured: every request will get 401 (set KVMESH_API_KEYS or the keys file)")
    return IngressState(
        settings=s, keyring=keyring, limiter=RateLimiter(s.rate_limit_per_s, s.rate_limit_burst),
        prompts=PromptBuilder(tokenizer, s.assistant_memory, eos_ids), gateway=gateway, metrics=metrics,
        model_id=s.model_id or model_dir.name, context_len=context_len, sessions=sessions,
        tool_format=select(tokenizer.chat_template_source, s.tool_parser),
    )


async def _prefix_locator(ctx: ServiceContext, model_dir: Path) -> PrefixLocator | None:
    """Cache-aware routing needs the weights' fingerprint (the one the workers' engine names its blocks with);
    without readable weights the ingress routes by load."""
    s = ctx.settings
    fingerprint_of = vllm_fingerprint if s.engine.backend == "vllm" else model_fingerprint
    try:
        fingerprint = await asyncio.to_thread(fingerprint_of, model_dir, s.engine.dtype)
    except (CheckpointError, ValueError) as exc:
        log.warning("no model fingerprint: prefill is routed by load only", error=str(exc))
        return None
    return PrefixLocator.create(ctx.nc, fingerprint, s.engine.block_size, s.ingress.index_timeout_s,
                                ctx.metrics.registry)


async def setup(ctx: ServiceContext) -> None:
    settings = ctx.settings
    # first: without the deployment's secret this replica would salt tenants unlike its peers (SecretError)
    secret = load_secret(settings.ingress_secret, settings.ingress.secret_file, settings.state_dir)
    if settings.model_dir is None:
        raise RuntimeError("KVMESH_MODEL_DIR is not set: the ingress needs the model's tokenizer")
    model_dir = Path(settings.model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    table = WorkerTable()
    watch = asyncio.create_task(table.run(ctx.js))
    metrics = IngressMetrics.create(ctx.metrics.registry)
    locator = await _prefix_locator(ctx, model_dir)
    gateway = Gateway(ctx.nc, ctx.publisher, table, settings.ingress, tokenizer.decode, metrics.retries.inc, locator,
                      on_stale_event=metrics.stale_events.inc)
    state = build_state(settings, gateway, tokenizer, metrics, model_dir, secret)
    traffic = state.sessions.traffic = TrafficRecorder(ctx.publisher, ctx.worker_id, ctx.metrics.registry)
    app = create_app(state)  # metrics stay on the runner's side port (service.http_port), off the public API
    server = _Server(uvicorn.Config(app, host=settings.ingress.host, port=settings.ingress.port,
                                   log_config=None, access_log=False, lifespan="off", http="httptools",
                                   timeout_graceful_shutdown=max(1, int(settings.service.drain_timeout_s))))
    # set first: the runner's side server answers /readyz while this setup is still running
    ctx.ready_check = lambda: server.started and gateway.ready()
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            watch.cancel()
            raise RuntimeError(f"ingress HTTP server did not start on {settings.ingress.host}:{settings.ingress.port}")
        await asyncio.sleep(0.02)
    log.info("ingress listening", url=f"http://{settings.ingress.host}:{settings.ingress.port}",
             model=state.model_id, keys=len(state.keyring))
    ctx.load = lambda: float(gateway.in_flight)
    ctx.capacity = float(settings.ingress.max_in_flight)

    async def stop() -> None:
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        await state.sessions.drain(settings.service.drain_timeout_s)  # the last turns' events
        await traffic.drain(settings.service.drain_timeout_s)  # and their traffic records
        watch.cancel()

    ctx.on_stop.append(stop)
