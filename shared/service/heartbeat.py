"""A worker's heartbeat: its `Heartbeat` in the `workers` KV bucket, written when it changes.

Every interval the loop samples what a heartbeat states (load, capacity,
KV-event position, tier sizes) and writes it if that differs from the last
write; an unchanged heartbeat is written again only when a third of the TTL
has passed (`keepalive_s`), to keep the entry alive. Every watcher (cache
index, eviction, each ingress) takes every write: an idle worker now costs
them one write per keep-alive instead of one per interval (0.6 of it at the
default 1 s interval and 5 s TTL), and a busy worker's load and event
position still reach them within an interval. Beats are jittered (see
`HeartbeatLoop.run`).

Each write carries a per-message TTL (`Nats-TTL`, nats-server 2.11+): if the
process stops writing (crash, partition), the entry expires `ttl_s` after the
last write and the server leaves a delete marker that watchers see as the
worker going down. A graceful stop deletes the key at once.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kvmesh.aio import wait_event
from kvmesh.log import get_logger
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol import subjects
from kvmesh.protocol.messages import Heartbeat, Role
from nats.js import JetStreamContext

log = get_logger(__name__)


@dataclass(slots=True)
class HeartbeatLoop:
    """Writes this worker's heartbeat until stopped; `load()` and `kv_position()` are sampled every interval."""

    js: JetStreamContext
    worker_id: str
    role: Role
    http_endpoint: str
    interval_s: float
    ttl_s: float
    metrics: ServiceMetrics
    load: Callable[[], float] = lambda: 0.0
    capacity: float = 1.0
    kv_position: Callable[[], tuple[int, int]] | None = None  # (epoch, seq) of the worker's published KV events
    l1_capacity_blocks: int | None = None  # a worker's tier sizes, for the eviction service (None: not a worker)
    l2_capacity_blocks: int | None = None
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    seq: int = 0
    _last_ok: float = field(default_factory=time.monotonic, init=False)
    _written: Heartbeat | None = field(default=None, init=False)  # the last write that succeeded
    _keepalive_at: float = field(default=0.0, init=False)  # when an unchanged heartbeat is written again
    _stop: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def __post_init__(self) -> None:
        subjects.token(self.worker_id)
        # Nats-TTL has whole-second resolution; the entry must outlive at least one missed beat.
        if self.ttl_s < 1 or self.ttl_s <= self.interval_s:
            raise ValueError(f"heartbeat ttl {self.ttl_s}s must be >= 1s and longer than the interval {self.interval_s}s")
        self.metrics.heartbeat_age_seconds.set_function(lambda: time.monotonic() - self._last_ok)

    @property
    def keepalive_s(self) -> float:
        """An unchanged heartbeat is written again after this long: a third of the TTL, at least the interval.

        A failed write is retried at the next look, an interval later: at the defaults (1 s, 5 s TTL) a
        keep-alive is due 1.67 s after the last write, and a lost one is retried well inside the
        entry's 5 s.
        """
        return max(self.interval_s, self.ttl_s / 3)

    def current(self) -> Heartbeat:
        epoch, kv_seq = self.kv_position() if self.kv_position is not None else (None, None)
        return Heartbeat(
            worker_id=self.worker_id, role=self.role, load=float(self.load()), capacity=float(self.capacity),
            started_at=self.started_at, http_endpoint=self.http_endpoint, seq=self.seq, ttl_s=self.ttl_s,
            kv_epoch=epoch, kv_seq=kv_seq, l1_capacity_blocks=self.l1_capacity_blocks,
            l2_capacity_blocks=self.l2_capacity_blocks,
        )

    @property
    def registered(self) -> bool:
        """True once a write has succeeded: from then on watchers (and routers) know this worker."""
        return self._written is not None

    def due(self, now: float) -> bool:
        """True if a write is due: nothing written yet, the state moved since the last write, or keep-alive time."""
        if self._written is None or now >= self._keepalive_at:
            return True
        return self.current().model_copy(update={"seq": self._written.seq}) != self._written

    async def beat(self) -> None:
        """One write; raises on failure (the loop logs and tries again next interval)."""
        self.seq += 1
        hb = self.current()
        started = time.monotonic()
        await self.js.publish(
            subjects.heartbeat_key(self.worker_id), hb.to_bytes(), timeout=max(0.5, self.interval_s),
            headers={subjects.HDR_MSG_ID: f"hb-{self.worker_id}-{self.started_at.timestamp():.6f}-{self.seq}"},
            msg_ttl=self.ttl_s,
        )
        self._last_ok = time.monotonic()
        self._written, self._keepalive_at = hb, started + self.keepalive_s

    async def run(self) -> None:
        """Beat at once; then look every 0.9-1.0 intervals (the first look at a random phase), writing when `due`.

        The first keep-alive comes at a random phase too. Without the jitter, workers started together
        (a rollout, a bench's batch of emulated workers, a fleet reconnecting after an outage) beat in
        lockstep: every watcher then takes the fleet's heartbeats in one burst, and whatever else its
        loop serves (lookups, routing) waits behind it. A wait never passes the keep-alive time, and
        after a failed write the next look (an interval on) writes again.
        """
        rng = random.Random()  # jitter only; nothing is derived from it
        wait = self.interval_s * rng.random()
        while not self._stop.is_set():
            if self.due(time.monotonic()):
                first = self._written is None
                try:
                    await self.beat()
                except Exception as exc:  # noqa: BLE001 - a missed beat is survivable; the TTL decides
                    log.warning("heartbeat failed", worker_id=self.worker_id, error=repr(exc))
                    self.metrics.heartbeat_failures.inc()
                else:
                    if first:
                        self._keepalive_at -= self.keepalive_s * rng.random()
            keepalive_in = self._keepalive_at - time.monotonic()
            await wait_event(self._stop, min(wait, keepalive_in) if keepalive_in > 0 else wait)
            wait = self.interval_s * (0.9 + 0.1 * rng.random())

    def stop(self) -> None:
        """Stop writing; the entry then expires after the TTL (what a crash looks like to watchers)."""
        self._stop.set()

    async def withdraw(self) -> None:
        """Graceful exit: delete the entry now so watchers need not wait for the TTL."""
        self.stop()
        kv = await self.js.key_value(subjects.WORKERS_BUCKET)
        await kv.delete(self.worker_id)
