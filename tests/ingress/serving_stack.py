"""A real serving stack for tests: prefill/decode/ingress subprocesses on the nats/s3 fixtures.

Every process is started with `python -m kvmesh.services.<name>` and its own
KVMESH_* environment, logs to a file in the stack's tmp dir, and is killed by
PID in `stop()` (run it in a fixture's finally). Heartbeat TTLs are short so
a killed worker is noticed within ~2 s. Every ingress of a stack gets the
stack's one salt secret (`KVMESH_INGRESS_SECRET`), as the replicas of a
deployment do; metrics are read from a process's side port (`metrics()`).
`own_nats` and the context managers built on it give a module its stack on
servers of its own; the functions at the end are what the error and fault
tests check and do (no job published, affinity keys, retries, a kill mid-stream).
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from kvmesh.ingress.routing.router import home
from kvmesh.net import free_port
from kvmesh.stack.probe import wait_http_ok
from kvmesh.stack.servers import ManagedProcess, NatsServer, S3Server, spawn_process


BUCKET = "kvmesh-ingress-tests"  # a stack's S3 bucket, unless it asks for one of its own


async def declare(nats_url: str) -> None:
    import nats
    from kvmesh.protocol.streams import declare_all

    nc = await nats.connect(nats_url)
    try:
        await declare_all(nc.jetstream())
    finally:
        await nc.close()


async def job_count(nats_url: str) -> int:
    """Messages ever stored in the JOBS stream (its last sequence): unchanged means nothing was published."""
    import nats

    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().stream_info("JOBS")
        return int(info.state.last_seq)
    finally:
        await nc.close()


@dataclass
class ServingStack:
    root: Path
    nats: NatsServer
    s3: S3Server | None
    model_dir: Path
    api_keys: dict[str, str]  # key -> tenant
    bucket: str = BUCKET
    ingress_port: int = 0
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    side_ports: dict[str, int] = field(default_factory=dict)  # worker id -> its side HTTP port (/metrics, /readyz)
    extra_env: dict[str, str] = field(default_factory=dict)
    secret: str = field(default_factory=lambda: secrets.token_hex(32))  # the deployment's salt secret

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ingress_port}"

    def env(self, worker_id: str, http_port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            KVMESH_NATS_URL=self.nats.url,
            KVMESH_STATE_DIR=str(self.root / "state"),
            KVMESH_MODEL_DIR=str(self.model_dir),
            KVMESH_SERVICE__WORKER_ID=worker_id,
            KVMESH_SERVICE__HTTP_PORT=str(http_port),
            KVMESH_SERVICE__HEARTBEAT_INTERVAL_S="0.5",
            KVMESH_SERVICE__HEARTBEAT_TTL_S="2",
            KVMESH_ENGINE__NUM_BLOCKS="512",
            KVMESH_TIERS__L2_CAPACITY_BYTES=str(64 * 1024 * 1024),
            # The tiny model computes a block faster than any tier restores one, so the restore gate would
            # turn the restores these tests check into recomputes (tests/serving/test_restore_gate.py tests it).
            KVMESH_WORKERS__RESTORE_GATE="false",
            KVMESH_API_KEYS=",".join(f"{k}:{t}" for k, t in self.api_keys.items()),
            KVMESH_INGRESS_SECRET=self.secret,
            KVMESH_INGRESS__PORT=str(self.ingress_port),
            KVMESH_LOG_LEVEL="info",
        )
        if self.s3 is not None:
            env.update(KVMESH_S3_ENDPOINT=self.s3.endpoint, KVMESH_S3_ACCESS_KEY=self.s3.access_key,
                       KVMESH_S3_SECRET_KEY=self.s3.secret_key, KVMESH_S3__BUCKET=self.bucket)
        else:
            env["KVMESH_TIERS__L3_ENABLED"] = "false"
        env.update(self.extra_env)
        return env

    def start(self, service: str, worker_id: str) -> int:
        """Start one service process; returns its side HTTP port (for /readyz)."""
        port = free_port()
        argv = [sys.executable, "-m", f"kvmesh.services.{service}"]
        self.procs[worker_id] = spawn_process(worker_id, argv, self.root / "logs" / f"{worker_id}.log",
                                              detach=False, env=self.env(worker_id, port))
        self.side_ports[worker_id] = port
        return port

    def metrics(self, worker_id: str = "ingress-0") -> str:
        """The Prometheus text of a process's side port (the public API port serves none)."""
        return httpx.get(f"http://127.0.0.1:{self.side_ports[worker_id]}/metrics", timeout=10).text

    def wait_ready(self, port: int, worker_id: str, timeout_s: float = 90.0) -> None:
        self._wait_200(worker_id, f"http://127.0.0.1:{port}/readyz", "not ready", timeout_s)

    def wait_http(self, worker_id: str, timeout_s: float = 60.0) -> None:
        """Wait until the ingress answers /healthz on its API port (it may be unready: no workers)."""
        self._wait_200(worker_id, f"{self.base_url}/healthz", "API not up", timeout_s)

    def _wait_200(self, worker_id: str, url: str, what: str, timeout_s: float) -> None:
        """Poll `url` until 200; a failure carries the process's log tail."""
        try:
            wait_http_ok(url, timeout_s, self.procs[worker_id].proc)
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{worker_id} {what}: {exc}\n{self.log(worker_id)[-3000:]}") from None

    def start_ready(self, service: str, worker_id: str) -> None:
        self.wait_ready(self.start(service, worker_id), worker_id)

    def log(self, worker_id: str) -> str:
        path = self.root / "logs" / f"{worker_id}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def signal(self, worker_id: str, sig: int) -> None:
        os.kill(self.procs[worker_id].pid, sig)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop(grace_s=3.0)  # SIGCONT included: a paused (SIGSTOPped) worker still stops
        self.procs.clear()


def make_stack(root: Path, nats: NatsServer, s3: S3Server | None, model_dir: Path,
               api_keys: dict[str, str], bucket: str = BUCKET, **extra_env: str) -> ServingStack:
    """A stack with streams declared and its S3 `bucket` made; nothing started yet."""
    asyncio.run(declare(nats.url))
    stack = ServingStack(root, nats, s3, model_dir, api_keys, bucket, ingress_port=free_port(), extra_env=extra_env)
    if s3 is not None:
        s3.ensure_bucket(stack.bucket)
    return stack


@contextmanager
def own_nats(root: Path, s3: S3Server | None, model_dir: Path, api_keys: dict[str, str], bucket: str = BUCKET,
             **extra_env: str) -> Iterator[ServingStack]:
    """A stack (as `make_stack` makes it) on a NATS server of its own, nothing started yet; on exit every
    process it started is stopped, then the server. `extra_env` (KVMESH_...) reaches every process."""
    nats = NatsServer(data_dir=root / "nats")
    nats.start()
    try:
        stack = make_stack(root, nats, s3, model_dir, api_keys, bucket, **extra_env)
        try:
            yield stack
        finally:
            stack.stop()
    finally:
        nats.stop()


@contextmanager
def own_nats_and_s3(root: Path, model_dir: Path, api_keys: dict[str, str],
                    **extra_env: str) -> Iterator[ServingStack]:
    """`own_nats` with an S3 server of its own too (`stack.s3`); both keep their data under `root`, so a
    test may stop and start them again."""
    s3 = S3Server(data_dir=root / "s3")
    s3.start()
    try:
        with own_nats(root, s3, model_dir, api_keys, **extra_env) as stack:
            yield stack
    finally:
        s3.stop()


@contextmanager
def one_of_each(root: Path, s3: S3Server | None, model_dir: Path, api_keys: dict[str, str],
                **extra_env: str) -> Iterator[ServingStack]:
    """A NATS server of its own plus one prefill, one decode and a ready ingress; all stopped on exit.
    `extra_env` (KVMESH_...) reaches every process."""
    with own_nats(root, s3, model_dir, api_keys, **extra_env) as stack:
        stack.start("prefill", "prefill-0")
        stack.start("decode", "decode-0")
        stack.start_ready("ingress", "ingress-0")  # ready = NATS + a live prefill and decode worker
        yield stack


@contextmanager
def ingress_alone(root: Path, model_dir: Path, api_keys: dict[str, str], **extra_env: str) -> Iterator[ServingStack]:
    """An ingress with no workers and no S3 on a NATS server of its own (no worker of another module is
    live there), its API up but never ready: a valid request is the 503 case. Stopped on exit."""
    with own_nats(root, None, model_dir, api_keys, **extra_env) as stack:
        stack.start("ingress", "ingress-0")
        stack.wait_http("ingress-0")
        yield stack


@contextmanager
def no_job_published(stack: ServingStack) -> Iterator[None]:
    """Asserts, when the block is over, that nothing was published to JOBS inside it (its last sequence held)."""
    before = asyncio.run(job_count(stack.nats.url))
    yield
    assert asyncio.run(job_count(stack.nats.url)) == before, "a rejected request published a job"


def key_homed_on(workers: list[str], target: str) -> str:
    """An affinity key (`prompt_cache_key`) whose rendezvous home among `workers` is `target`."""
    return next(k for k in (f"key-{i}" for i in range(1000)) if home(k, workers) == target)


def ingress_retries(stack: ServingStack) -> float:
    """kvmesh_ingress_retries_total of the stack's ingress-0 (0 before the first retry)."""
    match = re.search(r"^kvmesh_ingress_retries_total (\S+)$", stack.metrics(), re.M)
    return float(match.group(1)) if match else 0.0


def stream_killing(stack: ServingStack, client: openai.OpenAI, victim: str, route: str,
                   **create: Any) -> tuple[str, str | None]:
    """Stream a completion (`create`: completions.create's arguments) whose route header must name `route`,
    SIGKILL the stack's `victim` once its third chunk is in, and read on to the end: (text, finish reason)."""
    with client.completions.with_streaming_response.create(stream=True, **create) as response:
        assert route in response.headers["kvmesh-route"]
        parts: list[str] = []
        finish = None
        for i, chunk in enumerate(response.parse()):
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
            if i == 2:
                stack.signal(victim, signal.SIGKILL)
    return "".join(parts), finish
