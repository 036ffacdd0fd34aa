"""Live Belady: how far the fleet's cache is from the offline optimum, on the traffic it just served.

The eviction service feeds every `TrafficRecord` (stream TRAFFIC) into an
`AccessWindow` and every `period_s` replays the window through the same
code as `kvmesh sim` (shared/sim/run.py: `belady` and `infinite`) at the
fleet's L1 capacity. It exports the gauges

    kvmesh_cache_hit_rate_actual        blocks served from the serving worker's own L1 / prompt blocks
    kvmesh_cache_hit_rate_actual_any    ... from any tier (L1, L2, peer, L3)
    kvmesh_cache_hit_rate_belady        Belady's prefix hit rate at the fleet's L1 capacity
    kvmesh_cache_hit_rate_infinite      a cache that never evicts
    kvmesh_cache_belady_ratio           actual / belady (1.0: as good as the offline optimum)
    kvmesh_cache_infinite_ratio         actual_any / infinite (what every tier together reaches of the ceiling)
    kvmesh_cache_belady_window_accesses / _capacity_blocks

Pooled, not per worker: the capacity is the sum of the live prefill workers'
L1 pools (each as its heartbeat states, else `eviction.l1_capacity_blocks`,
else `engine.num_blocks`) and Belady runs once over the fleet's accesses.
That is the bound a perfect router plus a perfect eviction policy could
reach, so the gap includes placement (a prefix cached on another worker is
a miss for this one) as well as eviction; a per-worker bound would hide
the router's share of the gap. It is also exactly what `kvmesh sim
--l1-blocks <capacity>` computes on the recorded trace of the same window.

CPU: the replay runs in a thread on a snapshot; the next one waits at least
`period_s` and at least `last cost / max_cpu_share`, so recomputing never
takes more than that share of a core whatever the window holds. At 1,000
requests/s of Mooncake-shaped traffic the whole (upkeep through the bus +
recompute of the default window every 120 s) measured 3.6-3.8% of one core
(`kvmesh bench live-belady`; docs/operator-view.md). The replay's transient
memory is about 150 bytes per access (39 MB for the default window).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

from kvmesh.aio import cancel_and_wait
from kvmesh.config import LiveBeladySettings
from kvmesh.eviction.access_window import Access, AccessWindow, as_trace
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.protocol.base import ProtocolError
from kvmesh.protocol.messages import Role
from kvmesh.protocol.streams import TRAFFIC
from kvmesh.protocol.traffic import TrafficRecord
from kvmesh.service.watch import Change, follow_workers
from kvmesh.sim.run import run_one
from kvmesh.traffic.reader import iso_utc
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from prometheus_client import CollectorRegistry, Gauge

log = get_logger(__name__)


@dataclass(slots=True, frozen=True)
class LiveBeladyResult:
    requests: int
    accesses: int
    capacity_blocks: int
    actual: float
    actual_any: float
    belady: float
    infinite: float
    cpu_s: float  # what computing this took

    @property
    def belady_ratio(self) -> float:
        return self.actual / self.belady if self.belady else 0.0

    @property
    def infinite_ratio(self) -> float:
        return self.actual_any / self.infinite if self.infinite else 0.0


def compute(entries: list[Access], capacity_blocks: int) -> LiveBeladyResult:
    """Belady and infinite hit rates of `entries` at `capacity_blocks`, beside what was actually served."""
    t0 = time.process_time()
    trace = as_trace(entries)
    total = trace.input_blocks
    belady = run_one(trace, "belady", max(1, capacity_blocks)).hit_rate
    infinite = run_one(trace, "infinite", max(1, capacity_blocks)).hit_rate
    l1 = sum(e.l1_hits for e in entries)
    hits = sum(e.hits for e in entries)
    return LiveBeladyResult(len(entries), total, capacity_blocks, l1 / total if total else 0.0,
                            hits / total if total else 0.0, belady, infinite, time.process_time() - t0)


class _Gauges:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        def g(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=registry)

        self.actual = g("kvmesh_cache_hit_rate_actual", "Prompt blocks served from the worker's own L1, live window.")
        self.actual_any = g("kvmesh_cache_hit_rate_actual_any", "Prompt blocks served from any cache tier, live window.")
        self.belady = g("kvmesh_cache_hit_rate_belady", "Offline Belady prefix hit rate at the fleet's L1 capacity.")
        self.infinite = g("kvmesh_cache_hit_rate_infinite", "Prefix hit rate of a cache that never evicts.")
        self.belady_ratio = g("kvmesh_cache_belady_ratio", "Actual L1 hit rate / Belady hit rate.")
        self.infinite_ratio = g("kvmesh_cache_infinite_ratio", "Actual any-tier hit rate / infinite-cache hit rate.")
        self.accesses = g("kvmesh_cache_belady_window_accesses", "Block accesses in the live Belady window.")
        self.capacity = g("kvmesh_cache_belady_capacity_blocks", "Fleet L1 capacity the live Belady assumes.")

    def set(self, r: LiveBeladyResult) -> None:
        for name in ("actual", "actual_any", "belady", "infinite", "belady_ratio", "infinite_ratio"):
            getattr(self, name).set(getattr(r, name))
        self.accesses.set(r.accesses)
        self.capacity.set(r.capacity_blocks)


class LiveBelady:
    """The eviction service's live Belady: `start()` follows TRAFFIC and the prefill workers, `stop()` ends it.
    `latest` is the last result (None before the first)."""

    def __init__(self, js: JetStreamContext, settings: LiveBeladySettings, worker_blocks: int,
                 registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.time) -> None:
        self.js, self.settings, self.worker_blocks, self.clock = js, settings, worker_blocks, clock
        self.window = AccessWindow(settings.window_accesses, settings.window_s)
        self.prefill: dict[str, int] = {}  # live prefill worker -> its L1 blocks (heartbeat, else settings)
        self.latest: LiveBeladyResult | None = None
        self.skipped = 0
        self._gauges = _Gauges(registry)
        self._sub = None
        self._tasks: list[asyncio.Task[None]] = []

    def capacity_blocks(self) -> int:
        """Pooled L1 of the live prefill workers (those that served the window if none is known live)."""
        if self.settings.capacity_blocks is not None:  # the operator asked for a what-if capacity
            return self.settings.capacity_blocks
        if self.prefill:
            return sum(self.prefill.values())
        return (len(self.window.workers()) or 1) * self.worker_blocks

    def add(self, record: TrafficRecord) -> None:
        self.window.add(record)

    async def recompute(self) -> LiveBeladyResult:
        result = await asyncio.to_thread(compute, self.window.snapshot(), self.capacity_blocks())
        self.latest = result
        self._gauges.set(result)
        return result

    async def start(self) -> None:
        # A restarted service refills its window from what the stream kept of the last window_s.
        since = self.clock() - self.settings.window_s
        config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_TIME,
                                    opt_start_time=iso_utc(since))
        self._sub = await self.js.subscribe(subjects.TRAFFIC_ALL, stream=TRAFFIC.name, cb=self._on_record,
                                            ordered_consumer=True, config=config, idle_heartbeat=1.0)
        self._tasks = [asyncio.create_task(self._loop()), asyncio.create_task(self._watch())]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()

    async def _on_record(self, msg: Msg) -> None:
        try:
            self.add(TrafficRecord.from_bytes(msg.data))
        except ProtocolError:
            self.skipped += 1

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._wait())
            try:
                await self.recompute()
            except Exception:  # noqa: BLE001 - a failed pass leaves the last gauges; the next one retries
                log.exception("live belady pass failed")

    def _wait(self) -> float:
        """At least period_s, and long enough that the last pass's CPU stays under max_cpu_share."""
        cost = self.latest.cpu_s if self.latest is not None else 0.0
        return max(self.settings.period_s, cost / self.settings.max_cpu_share)

    async def _watch(self) -> None:
        async for change in follow_workers(self.js):
            if change.change is Change.DOWN:
                self.prefill.pop(change.worker_id, None)
            elif change.heartbeat is not None and change.heartbeat.role is Role.PREFILL:
                self.prefill[change.worker_id] = change.heartbeat.l1_capacity_blocks or self.worker_blocks
