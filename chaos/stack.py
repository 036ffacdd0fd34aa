"""The stack a chaos scenario runs against: real NATS, real S3, 2 prefill + 2 decode workers, one ingress,
one cache index and one eviction service.

NATS is one node or a cluster of `nats_nodes` (JetStream streams then R3,
every node syncing always), so a stream leader can be killed. Workers reach
each NATS node and S3 through a `FaultProxy` of its own (the ingress reaches
NATS directly), so latency, blackholes and resets can be injected between
the workers and their dependencies. Every process is a child started with
`python -m kvmesh.services.<name>`; `stop()` kills them all by PID and checks that
no process or port is left behind.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.chaos.proxy import FaultProxy
from kvmesh.net import free_port, port_in_use
from kvmesh.stack.declare import declare_streams
from kvmesh.stack.probe import wait_http_ok
from kvmesh.stack.servers import (
    ManagedProcess,
    NatsServer,
    S3Server,
    nats_cluster,
    pid_alive,
    spawn_process,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

API_KEY = "sk-chaos"
PREFILLS = ("prefill-0", "prefill-1")
DECODES = ("decode-0", "decode-1")
WORKERS = PREFILLS + DECODES
INDEX = "index-0"
EVICTION = "eviction-0"
BUCKET = "kvmesh-chaos"


@dataclass
class ChaosStack:
    root: Path
    model_dir: Path
    nats_nodes: int = 1
    nats: list[NatsServer] = field(default_factory=list)
    s3: S3Server = field(init=False)
    nats_proxies: list[FaultProxy] = field(default_factory=list)
    s3_proxy: FaultProxy = field(init=False)
    ingress_port: int = field(default_factory=free_port)
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    services: dict[str, str] = field(default_factory=dict)  # service id -> its package under services/
    ports: dict[str, int] = field(default_factory=dict)  # service id -> its side HTTP port
    secret: str = field(default_factory=lambda: secrets.token_hex(32))  # the ingress's salt secret, kept on restarts

    @property
    def nats_urls(self) -> list[str]:
        return [node.url for node in self.nats]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ingress_port}"

    def start(self, ready_timeout_s: float = 120.0) -> ChaosStack:
        """NATS, S3, proxies, streams, bucket, then every service; returns once all are ready and live."""
        self.nats = _nats_nodes(self.root, self.nats_nodes)
        for node in self.nats:
            node.start()
        self.s3 = S3Server(data_dir=self.root / "s3")
        self.s3.start()
        self.s3.ensure_bucket(BUCKET)
        declare_streams(",".join(self.nats_urls), 3 if self.nats_nodes >= 3 else 1, ready_timeout_s)
        self.nats_proxies = [FaultProxy(node.port).start() for node in self.nats]
        self.s3_proxy = FaultProxy(self.s3.port).start()
        for worker in PREFILLS:
            self.spawn("prefill", worker)
        for worker in DECODES:
            self.spawn("decode", worker)
        self.spawn("cache_index", INDEX)
        self.spawn("eviction", EVICTION)
        self.spawn("ingress", "ingress-0")
        for service_id in self.procs:
            self.wait_ready(service_id, ready_timeout_s)
        self.wait_live(ready_timeout_s)
        return self

    def env(self, service_id: str) -> dict[str, str]:
        via_proxy = service_id != "ingress-0"
        env = dict(os.environ)
        env.update(
            KVMESH_NATS_URL=",".join(f"nats://{p.endpoint}" for p in self.nats_proxies) if via_proxy
            else ",".join(self.nats_urls),
            KVMESH_STATE_DIR=str(self.root / "state"),
            KVMESH_MODEL_DIR=str(self.model_dir),
            KVMESH_SERVICE__WORKER_ID=service_id,
            KVMESH_SERVICE__HTTP_PORT=str(self.ports[service_id]),
            KVMESH_SERVICE__HEARTBEAT_INTERVAL_S="0.5",
            KVMESH_SERVICE__HEARTBEAT_TTL_S="2",
            # kvmesh's own engine: four vLLM workers (3 GB each, plus their compile) do not fit a small box, and
            # the scenarios are about the fleet's protocol, which both engines serve
            KVMESH_ENGINE__BACKEND="native",
            KVMESH_ENGINE__NUM_BLOCKS="512",
            KVMESH_TIERS__L2_CAPACITY_BYTES=str(64 * 1024 * 1024),
            KVMESH_TIERS__L3_CHUNK_TOKENS="32",  # short prompts reach L3 (2 blocks a chunk)
            KVMESH_TIERS__L2_SHARED_MEMORY="false",  # a worker without a prefix reads L3, not a peer's shm
            KVMESH_API_KEYS=f"{API_KEY}:chaos",
            KVMESH_INGRESS_SECRET=self.secret,
            KVMESH_INGRESS__PORT=str(self.ingress_port),
            KVMESH_INGRESS__FIRST_TOKEN_TIMEOUT_S="10",
            KVMESH_INGRESS__INTER_TOKEN_TIMEOUT_S="5",
            KVMESH_INGRESS__MAX_IN_FLIGHT="6",  # chaos.overload.OVERLOAD_LIMIT: the steady load stays below it
            KVMESH_S3_ENDPOINT=self.s3_proxy.endpoint if via_proxy else self.s3.endpoint,
            KVMESH_S3_ACCESS_KEY=self.s3.access_key,
            KVMESH_S3_SECRET_KEY=self.s3.secret_key,
            KVMESH_S3__BUCKET=BUCKET,
            KVMESH_EVICTION__GC_INTERVAL_S="2",  # the GC window the l3_intact invariant allows
            KVMESH_LOG_LEVEL="info",
        )
        return env

    def spawn(self, service: str, service_id: str) -> None:
        """Start `service` as `service_id`; a process still running under that id is stopped first, so a
        restart never leaves the old one behind (it would hold the port and outlive `stop()`)."""
        old = self.procs.get(service_id)
        if old is not None and old.proc.poll() is None:
            old.stop(grace_s=3.0)
        self.ports.setdefault(service_id, free_port())
        self.services[service_id] = service
        argv = [sys.executable, "-m", f"kvmesh.services.{service}"]
        self.procs[service_id] = spawn_process(service_id, argv, self.root / "logs" / f"{service_id}.log",
                                               detach=False, env=self.env(service_id))

    def restart(self, service_id: str, timeout_s: float = 120.0, wait_all: bool = True) -> None:
        """Start a killed service again under the same id; wait until it is ready and (wait_all) every
        worker is live again."""
        self.spawn(self.services[service_id], service_id)
        self.wait_ready(service_id, timeout_s)
        if wait_all:
            self.wait_live(timeout_s)

    def wait_ready(self, service_id: str, timeout_s: float) -> None:
        try:
            wait_http_ok(f"http://127.0.0.1:{self.ports[service_id]}/readyz", timeout_s, self.procs[service_id].proc)
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{service_id} not ready: {exc}\n{self.log(service_id)[-3000:]}") from None

    def wait_live(self, timeout_s: float) -> None:
        """Every worker's heartbeat is live in NATS (the ingress routes to all of them)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if set(WORKERS) <= asyncio.run(_alive(self.nats_urls)):
                return
            time.sleep(0.3)
        raise TimeoutError("workers did not all become live")

    def wait_down(self, worker: str, timeout_s: float) -> None:
        """`worker`'s heartbeat is gone from NATS (the ingress stops routing to it)."""
        deadline = time.monotonic() + timeout_s
        while worker in asyncio.run(_alive(self.nats_urls)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{worker} still live after {timeout_s}s")
            time.sleep(0.3)

    def signal(self, service_id: str, sig: int) -> None:
        os.kill(self.procs[service_id].pid, sig)

    def kill_nats_leader(self, stream: str = "JOBS") -> str:
        """SIGKILL the NATS node that leads `stream` (a cluster only); returns its server name."""
        if len(self.nats) < 3:
            raise RuntimeError("a leader kill needs the 3-node cluster (nats_nodes=3)")
        leader = asyncio.run(_stream_leader(self.nats_urls, stream))
        node = next(n for n in self.nats if n.server_name == leader)
        assert node.process is not None
        os.kill(node.process.pid, signal.SIGKILL)
        node.process.proc.wait(10)
        return leader

    def restart_dead_nats(self) -> None:
        """Start every NATS node whose process has died again, on its old ports and store."""
        for node in self.nats:
            if node.process is not None and node.process.proc.poll() is not None:
                node.start()

    def log(self, service_id: str) -> str:
        path = self.root / "logs" / f"{service_id}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> list[str]:
        """Stop everything; returns what leaked (live PIDs, bound ports) — empty when clean."""
        pids = [p.pid for p in self.procs.values()]
        ports = list(self.ports.values()) + [self.ingress_port]
        for proc in self.procs.values():
            proc.stop(grace_s=3.0)  # SIGCONT included: a paused (SIGSTOPped) worker still stops
        self.procs.clear()
        for proxy in self.nats_proxies + ([self.s3_proxy] if hasattr(self, "s3_proxy") else []):
            ports.append(proxy.port)
            proxy.stop()
        for server in self.nats + ([self.s3] if hasattr(self, "s3") else []):
            if server.process is not None:
                pids.append(server.process.pid)
                ports.append(server.port)
            server.stop()
        return [f"pid {p}" for p in pids if pid_alive(p)] + [f"port {p}" for p in ports if port_in_use(p)]


def _nats_nodes(root: Path, n: int) -> list[NatsServer]:
    """One node, or n nodes routed to each other."""
    return [NatsServer(data_dir=root / "nats")] if n <= 1 else nats_cluster(root, n, "kvmesh-chaos")


@asynccontextmanager
async def nats_client(nats_urls: list[str]) -> AsyncIterator[NATS]:
    """A plain connection for one check or fault (no reconnects needed), closed on exit."""
    import nats

    nc = await nats.connect(servers=nats_urls)
    try:
        yield nc
    finally:
        await nc.close()


async def _alive(nats_urls: list[str]) -> set[str]:
    from kvmesh.service.watch import alive_workers

    async with nats_client(nats_urls) as nc:
        return set(await alive_workers(nc.jetstream()))


async def _stream_leader(nats_urls: list[str], stream: str) -> str:
    async with nats_client(nats_urls) as nc:
        info = await nc.jetstream().stream_info(stream)
    if info.cluster is None or not info.cluster.leader:
        raise RuntimeError(f"stream {stream} reports no cluster leader")
    return info.cluster.leader


async def stream_backlog(nats_urls: list[str], streams: tuple[str, ...] = ("JOBS", "HANDOFF")) -> dict[str, int]:
    """Messages still held by each work-queue stream (acked ones are deleted): 0 means nothing is pending."""
    async with nats_client(nats_urls) as nc:
        js = nc.jetstream()
        return {name: int((await js.stream_info(name)).state.messages) for name in streams}
