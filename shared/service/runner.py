"""The service runner: the thin shell every kvmesh service process runs in.

A service is a `setup(ctx)` coroutine that registers its consumers, request
endpoints, readiness check and load gauge on a `ServiceContext`; its business
logic lives in `shared/`. `services/<name>/__main__.py` is then one line:

    raise SystemExit(run_service("prefill", Role.PREFILL, setup))

Contract with the stack launcher (`kvmesh up`):
- started as `python -m kvmesh.services.<name>`; all settings come from KVMESH_*
  env vars (`kvmesh.config.Settings`), in particular `KVMESH_NATS_URL`,
  `KVMESH_SERVICE__HTTP_PORT` (0 = any free port) and
  `KVMESH_SERVICE__WORKER_ID` (default `<name>-<pid>`; letters, digits, '-'
  and '_' only: it becomes part of subjects and KV keys); `KVMESH_LOG_LEVEL`;
  `KVMESH_NATS_USER`/`KVMESH_NATS_PASSWORD` (and `KVMESH_NATS_TLS_*`) when
  NATS has users: replies come to `_INBOX.<role>.<worker id>`, the one inbox
  prefix that user may read (shared/bus/permissions.py).
  NATS may still be starting: the first connect is retried for
  `bus.connect_retry_total_s` (30 s) before the process exits 1.
- the launcher runs `kvmesh.protocol.streams.declare_all` before starting
  services; the runner does not declare shared streams, only its own
  per-worker consumers.
- `GET http://<http_host>:<port>/readyz` answers 200 once NATS is connected,
  every consumer is bound, the service's own check passes and its first
  heartbeat is written (a router reading the `workers` bucket can see it);
  503 with the failing checks before that and while draining. `/healthz`
  200 while the process lives; `/metrics` Prometheus text (kvmesh_* names).
- logs are JSON lines on stderr, one startup line `service ready` carries
  `http_endpoint` and `worker_id`; the worker's `Heartbeat` (role, load,
  capacity, http endpoint) is in the `workers` KV bucket under its id.
- SIGTERM or SIGINT: readiness goes false, consumers stop fetching,
  in-flight handlers finish (up to `service.drain_timeout_s`), request
  endpoints drain, the heartbeat entry is withdrawn, the NATS connection is
  drained, and the process exits 0. A failure during startup exits 1.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import uvloop
from kvmesh.bus.client_auth import ClientAuth
from kvmesh.bus.connection import close, connect
from kvmesh.bus.consumer import ConsumerLoop, Handler
from kvmesh.bus.permissions import inbox_prefix
from kvmesh.bus.publish import Publisher
from kvmesh.bus.request import Responder, serve
from kvmesh.config import Settings, load_settings
from kvmesh.log import configure_logging, get_logger
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol import subjects
from kvmesh.protocol.base import Message
from kvmesh.protocol.messages import Role
from kvmesh.protocol.streams import ConsumerSpec
from kvmesh.service.heap import freeze_startup_heap
from kvmesh.service.heartbeat import HeartbeatLoop
from kvmesh.service.http import SideServer
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

log = get_logger(__name__)

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A request/reply endpoint: requests on `subject` decoded as `request_model`, answered by `handler`."""

    subject: str
    request_model: type[Message]
    handler: Callable[[Message], Awaitable[Message]]
    queue: str


@dataclass(slots=True)
class ServiceContext:
    """What `setup` gets: the connection, identity, settings, and the registration calls."""

    name: str
    role: Role
    worker_id: str
    settings: Settings
    nc: NATS
    js: JetStreamContext
    publisher: Publisher
    metrics: ServiceMetrics
    consumers: list[ConsumerLoop] = field(default_factory=list)
    endpoints: list[Endpoint] = field(default_factory=list)
    ready_check: Callable[[], bool] = lambda: True
    load: Callable[[], float] | None = None  # default: messages in flight across this service's consumers
    capacity: float = 1.0
    kv_position: Callable[[], tuple[int, int]] | None = None  # a worker's KV event log position, for heartbeats
    l1_capacity_blocks: int | None = None  # a worker's tier sizes in blocks, for heartbeats
    l2_capacity_blocks: int | None = None
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    def add_consumer(self, spec: ConsumerSpec, handler: Handler) -> ConsumerLoop:
        loop = ConsumerLoop(self.js, spec, handler, self.publisher, self.metrics, self.settings.bus,
                            self.settings.service.drain_timeout_s)
        self.consumers.append(loop)
        return loop

    def add_endpoint(self, subject: str, request_model: type[Message],
                     handler: Callable[[Message], Awaitable[Message]], queue: str | None = None) -> None:
        """A request/reply endpoint, load-shared across replicas through queue group `queue` (default: name)."""
        self.endpoints.append(Endpoint(subject, request_model, handler, queue or self.name))


Setup = Callable[[ServiceContext], Awaitable[None]]


class ServiceRunner:
    """Runs one service until a signal (or `stop()`); see the module docstring for the contract."""

    def __init__(self, name: str, role: Role, setup: Setup, settings: Settings | None = None,
                 freeze_heap: bool = False) -> None:
        self.name, self.role, self._setup = name, role, setup
        self._freeze_heap = freeze_heap  # a process of its own: freeze its startup heap once up (heap.py)
        self.settings = settings or load_settings()
        self.worker_id = subjects.token(self.settings.service.worker_id or f"{name}-{os.getpid()}")
        self.metrics = ServiceMetrics.create(name)
        self.ctx: ServiceContext | None = None
        self.http_endpoint = ""
        self._stop = asyncio.Event()
        self._draining = False
        self._started = asyncio.Event()
        self._heartbeat: HeartbeatLoop | None = None

    def stop(self) -> None:
        """Begin the graceful drain (what SIGTERM does)."""
        self._stop.set()

    async def wait_started(self) -> None:
        await self._started.wait()

    def readiness(self) -> dict[str, bool]:
        ctx = self.ctx
        return {
            "nats_connected": bool(ctx and ctx.nc.is_connected),
            "consumers_bound": bool(ctx and all(c.ready for c in ctx.consumers)),
            "service": bool(ctx and _safe(ctx.ready_check)),
            "endpoints_bound": self._started.is_set(),  # setup done, request endpoints subscribed
            "registered": bool(self._heartbeat and self._heartbeat.registered),  # routers can see this worker
            "not_draining": not self._draining,
        }

    async def run(self) -> int:
        """Serve until stopped; returns the exit code (0 after a clean drain)."""
        s = self.settings
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._stop.set)
            except (RuntimeError, ValueError):  # not the main thread (in-process tests): stop() only
                pass
        http = SideServer(s.service.http_host, s.service.http_port, self.readiness, self.metrics)
        nc: NATS | None = None
        tasks: list[asyncio.Task[None]] = []
        try:
            self.http_endpoint = await http.start()
            auth = ClientAuth.from_settings(s, inbox_prefix(self.role.value, self.worker_id))
            nc = await connect(s.nats_url or DEFAULT_NATS_URL, f"{self.name}:{self.worker_id}", s.bus, auth)
            js = nc.jetstream()
            self.ctx = ctx = ServiceContext(self.name, self.role, self.worker_id, s, nc, js,
                                            Publisher(js, s.bus, self.metrics), self.metrics)
            await self._setup(ctx)
            subs = [await serve(nc, e.subject, e.request_model, e.handler, e.queue) for e in ctx.endpoints]
            await nc.flush()  # the server holds the endpoints' subscriptions before anyone is told we are ready
            consumer_tasks = [asyncio.create_task(c.run()) for c in ctx.consumers]
            tasks += consumer_tasks
            await asyncio.gather(*(_bound(c, t) for c, t in zip(ctx.consumers, consumer_tasks, strict=True)))
            heartbeat = HeartbeatLoop(js, self.worker_id, self.role, self.http_endpoint,
                                      s.service.heartbeat_interval_s, s.service.heartbeat_ttl_s, self.metrics,
                                      load=ctx.load or (lambda: float(sum(c.in_flight for c in ctx.consumers))),
                                      capacity=ctx.capacity, kv_position=ctx.kv_position,
                                      l1_capacity_blocks=ctx.l1_capacity_blocks,
                                      l2_capacity_blocks=ctx.l2_capacity_blocks)
            self._heartbeat = heartbeat
            tasks.append(asyncio.create_task(heartbeat.run()))
            frozen = freeze_startup_heap() if self._freeze_heap else 0
            log.info("service ready", http_endpoint=self.http_endpoint, worker_id=self.worker_id, frozen_objects=frozen)
            self._started.set()
            await self._stop.wait()
            log.info("draining", worker_id=self.worker_id)
            return await self._drain(nc, subs, consumer_tasks, heartbeat)
        except Exception:
            log.exception("service failed", worker_id=self.worker_id)
            return 1
        finally:
            for t in tasks:
                t.cancel()
            if nc is not None:
                await close(nc)
            await http.stop()
            self._started.set()  # never leave a waiter hanging on a failed start

    async def _drain(self, nc: NATS, subs: list[Responder], consumer_tasks: list[asyncio.Task[None]],
                     heartbeat: HeartbeatLoop) -> int:
        self._draining = True  # /readyz -> 503 first, so routers stop sending here
        ctx = self.ctx
        assert ctx is not None
        for c in ctx.consumers:
            c.stop()
        await asyncio.gather(*consumer_tasks, return_exceptions=True)  # each bounded by drain_timeout_s
        for sub in subs:
            await sub.drain()
        for hook in ctx.on_stop:
            await hook()
        try:
            await heartbeat.withdraw()
        except Exception as exc:  # noqa: BLE001 - the TTL removes it anyway
            log.warning("heartbeat withdraw failed", error=repr(exc))
        await close(nc, drain=True)
        log.info("drained", worker_id=self.worker_id)
        return 0


def run_service(name: str, role: Role, setup: Setup, settings: Settings | None = None) -> int:
    """Process entry point: configure logging, run the service, return the exit code."""
    runner = ServiceRunner(name, role, setup, settings, freeze_heap=True)
    configure_logging(runner.settings.log_level, service=name, worker_id=runner.worker_id)
    # uvloop: every hop of a request wakes a loop in some service; libuv's loop costs less per wake-up
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop:
        return loop.run(runner.run())


def _safe(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception as exc:  # noqa: BLE001 - a crashing check means "not ready", not a 500
        log.warning("readiness check raised", error=repr(exc))
        return False


async def _bound(consumer: ConsumerLoop, task: asyncio.Task[None]) -> None:
    """Wait until `consumer` is bound; raise its error if it dies first (startup then fails fast)."""
    ready = asyncio.ensure_future(consumer.wait_ready())
    await asyncio.wait({ready, task}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        ready.cancel()
        task.result()
        raise RuntimeError(f"consumer {consumer.spec.durable} exited before it was ready")
