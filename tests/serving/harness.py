"""Worker processes for serving tests, and a small stand-in for the ingress's side of the protocol.

`WorkerProcs` starts `python -m kvmesh.services.prefill|decode` as real subprocesses
against the session NATS / S3 servers and a tiny model, waits until their
/readyz answers, and stops every one of them by PID. `TokenCollector` does
what the ingress does with a request's token events: subscribe before the
job is published, drop seqs already delivered, buffer out-of-order ones;
`send` publishes a job in that order.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bus.helpers import FAST_BUS, connected
from kvmesh.bus.publish import Publisher
from kvmesh.protocol import subjects
from kvmesh.protocol.serving import DecodeJob, PrefillJob, SamplingSpec, TokenEvent
from kvmesh.stack.servers import ManagedProcess, spawn_process
from nats.aio.client import Client as NATS

BLOCK_SIZE = 16
SALT_A = "a1" * 32
SALT_B = "b2" * 32


def declare_streams(url: str) -> None:
    """Declare the streams, consumers and buckets the workers bind to (what a stack's declare step does)."""

    async def declare() -> None:
        async with connected(url):
            pass

    asyncio.run(declare())


def unique(prefix: str = "r") -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


@dataclass
class WorkerProc:
    worker_id: str
    proc: ManagedProcess
    http_endpoint: str = ""

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.proc.wait(timeout=10)

    def ready_line(self) -> dict | None:
        for line in self.proc.log_path.read_text(errors="replace").splitlines():
            if '"service ready"' in line:
                return json.loads(line)
        return None


@dataclass
class WorkerProcs:
    env: dict[str, str]
    log_dir: Path
    procs: dict[str, WorkerProc] = field(default_factory=dict)

    def start(self, role: str, worker_id: str, **extra_env: str) -> WorkerProc:
        env = {**self.env, "KVMESH_SERVICE__WORKER_ID": worker_id, **extra_env}
        mp = spawn_process(worker_id, [sys.executable, "-m", f"kvmesh.services.{role}"], self.log_dir / f"{worker_id}.log",
                           detach=False, env=env)
        wp = WorkerProc(worker_id, mp)
        self.procs[worker_id] = wp
        return wp

    def wait_ready(self, only: list[WorkerProc] | None = None, timeout_s: float = 120.0) -> None:
        """Wait until every started process (or those in `only`) answers /readyz 200."""
        end = time.monotonic() + timeout_s
        for wp in only if only is not None else list(self.procs.values()):
            while True:
                if wp.proc.proc.poll() is not None:
                    raise RuntimeError(f"{wp.worker_id} exited: {wp.proc.log_path.read_text()[-3000:]}")
                line = wp.ready_line()
                if line is not None:
                    wp.http_endpoint = line["http_endpoint"]
                    if httpx.get(f"{wp.http_endpoint}/readyz", timeout=2).status_code == 200:
                        break
                if time.monotonic() > end:
                    raise RuntimeError(f"{wp.worker_id} not ready in {timeout_s}s: {wp.proc.log_path.read_text()[-3000:]}")
                time.sleep(0.2)

    def metric(self, worker_id: str, name: str) -> float:
        text = httpx.get(f"{self.procs[worker_id].http_endpoint}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop_all(self) -> None:
        for wp in self.procs.values():
            if wp.proc.proc.poll() is None:
                wp.proc.stop(grace_s=5.0)


def worker_env(nats_url: str, s3, bucket: str, model_dir: Path, state_dir: Path, audit_rate: float = 0.0) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        KVMESH_NATS_URL=nats_url,
        KVMESH_S3_ENDPOINT=s3.endpoint,
        KVMESH_S3_ACCESS_KEY=s3.access_key,
        KVMESH_S3_SECRET_KEY=s3.secret_key,
        KVMESH_S3__BUCKET=bucket,
        KVMESH_MODEL_DIR=str(model_dir),
        KVMESH_STATE_DIR=str(state_dir),
        KVMESH_SERVICE__HTTP_PORT="0",
        KVMESH_SERVICE__HEARTBEAT_INTERVAL_S="0.5",
        KVMESH_SERVICE__HEARTBEAT_TTL_S="2",
        KVMESH_SERVICE__DRAIN_TIMEOUT_S="3",
        KVMESH_ENGINE__BLOCK_SIZE=str(BLOCK_SIZE),
        KVMESH_ENGINE__NUM_BLOCKS="512",
        KVMESH_TIERS__L2_CAPACITY_BYTES=str(64 * 2**20),
        KVMESH_WORKERS__RESTORE_GATE="false",  # as in tests/ingress/serving_stack.py: the restores are what is tested
        KVMESH_BUS__FETCH_TIMEOUT_S="0.5",
        KVMESH_BUS__NAK_DELAY_S="0.2",
        KVMESH_AUDIT_RATE=str(audit_rate),
        KVMESH_LOG_LEVEL="info",
    )
    return env


@contextmanager
def worker_stack(nats_server, s3_server, bucket: str, model_dir: Path, state_dir: Path,
                 workers: Sequence[tuple[str, str]] = (("prefill", "pf-"), ("decode", "dc-")), audit_rate: float = 0.0,
                 **env: str) -> Iterator[WorkerProcs]:
    """The streams declared, `bucket` made, and one worker per (role, id prefix) of `workers` started, ready,
    and stopped after; `env` adds settings to every worker's environment."""
    declare_streams(nats_server.url)  # the streams the workers consume from
    s3_server.ensure_bucket(bucket)
    procs = WorkerProcs({**worker_env(nats_server.url, s3_server, bucket, model_dir, state_dir, audit_rate), **env},
                        state_dir / "logs")
    try:
        for role, prefix in workers:
            procs.start(role, unique(prefix))
        procs.wait_ready()
        yield procs
    finally:
        procs.stop_all()


def prefill_job(request_id: str, prompt_ids: list[int], decode_worker: str, max_tokens: int, salt: str = SALT_A,
                attempt: int = 0, deadline_s: float = 120.0, **kw) -> PrefillJob:
    return PrefillJob(request_id=request_id, attempt=attempt, tenant="t", tenant_salt=salt, prompt_ids=prompt_ids,
                      sampling=SamplingSpec(max_tokens=max_tokens), decode_worker=decode_worker,
                      deadline=time.time() + deadline_s, **kw)


@dataclass
class TokenCollector:
    """The ingress's view of one request: tokens in seq order, each once, and the final event."""

    request_id: str
    tokens: dict[int, int] = field(default_factory=dict)  # seq -> token id
    events: list[TokenEvent] = field(default_factory=list)
    final: TokenEvent | None = None
    dropped: int = 0  # tokens whose seq was already delivered (a retried or migrated hop resending)
    last_event_at: float = field(default_factory=time.monotonic)
    _sub: object = None
    _done: asyncio.Event = field(default_factory=asyncio.Event)

    async def subscribe(self, nc: NATS) -> TokenCollector:
        self._sub = await nc.subscribe(subjects.tokens(self.request_id), cb=self._on_msg)
        return self

    async def _on_msg(self, msg) -> None:
        ev = TokenEvent.from_bytes(msg.data)
        self.events.append(ev)
        self.last_event_at = time.monotonic()
        for i, tok in enumerate(ev.token_ids):
            if ev.seq + i in self.tokens:
                self.dropped += 1
            else:
                self.tokens[ev.seq + i] = tok
        if ev.finished and self.final is None:
            self.final = ev
            self._done.set()

    @property
    def ordered(self) -> list[int]:
        out = []
        while len(out) in self.tokens:
            out.append(self.tokens[len(out)])
        return out

    async def wait_final(self, timeout_s: float = 60.0) -> TokenEvent:
        await asyncio.wait_for(self._done.wait(), timeout_s)
        assert self.final is not None
        return self.final

    async def wait_silence(self, silence_s: float, timeout_s: float) -> bool:
        """True once no event arrived for silence_s (before any final event); False if it finished."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.final is not None:
                return False
            if time.monotonic() - self.last_event_at >= silence_s:
                return True
            await asyncio.sleep(0.05)
        raise AssertionError(f"{self.request_id}: neither silence nor an end within {timeout_s}s")

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()


async def send(nc: NATS, subject: str, job: PrefillJob | DecodeJob) -> TokenCollector:
    """Subscribe to the job's tokens, then publish it on `subject` (the ingress's order), under the
    protocol's message id `request_id:attempt`."""
    coll = await TokenCollector(job.request_id).subscribe(nc)
    await Publisher(nc.jetstream(), FAST_BUS).publish(subject, job, msg_id=f"{job.request_id}:{job.attempt}")
    return coll


async def send_prefill(nc: NATS, prefill_worker: str, job: PrefillJob) -> TokenCollector:
    return await send(nc, subjects.jobs_prefill(prefill_worker), job)


async def later_request(nc: NATS, prefill_worker: str, decode_worker: str, max_tokens: int = 16) -> TokenEvent:
    """Run a later request through `prefill_worker` -> `decode_worker` to its final event.

    Each worker takes it after whatever was sent to it before, and it decodes `max_tokens` steps
    (no eos): by its end, a shorter run started before it has sent all it ever will.
    """
    job = prefill_job(unique(), [11, 12, 13, 14, 15], decode_worker, max_tokens)
    job = job.model_copy(update={"sampling": SamplingSpec(max_tokens=max_tokens, ignore_eos=True)})
    later = await send_prefill(nc, prefill_worker, job)
    final = await later.wait_final()
    await later.close()
    assert final.error is None and final.finish_reason == "length", final
    return final
