"""The cache-index service: KV events in, longest-prefix lookups out, snapshots, gap repair, purges.

Each replica reads the WHOLE KV_EVENTS stream through its own ordered
consumer (ephemeral, in stream order), so every replica builds the same
index; lookups are a queue group, so any replica answers. On start a replica
loads the latest snapshot and replays the stream from the sequence after
it; it reports ready once it has applied everything the stream held at
start (until then lookups answer with `ready=False`). A sequence gap of a
worker triggers a state dump from that worker (retried until the gap closes
or the worker is purged). A worker whose heartbeat lapses is purged, and so,
once ready, is every indexed worker without a live heartbeat. The
state is snapshotted every `snapshot_every_events` events or
`snapshot_every_s` seconds, on request, and on stop.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress

from kvmesh.aio import cancel_and_wait
from kvmesh.bus.object_store import ObjectReadError
from kvmesh.cache_index import snapshot
from kvmesh.cache_index.feeds import IndexState
from kvmesh.cache_index.index import keys_of
from kvmesh.cache_index.messages import (
    LookupReply,
    LookupRequest,
    SnapshotReply,
    SnapshotRequest,
)
from kvmesh.cache_index.metrics import IndexMetrics
from kvmesh.config import IndexSettings
from kvmesh.kv_events.dump import DumpError, fetch_dump
from kvmesh.kv_events.events import KVEventBatch
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.protocol.base import ProtocolError
from kvmesh.protocol.messages import Heartbeat
from kvmesh.protocol.streams import KV_EVENTS
from kvmesh.service.runner import ServiceContext
from kvmesh.service.watch import Change, alive_workers, follow_workers
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from prometheus_client import CollectorRegistry

log = get_logger(__name__)

_DUMP_ATTEMPTS = 30  # a dead worker's dumps fail until its heartbeat lapses and it is purged


class CacheIndex:
    """One replica. `start()` then serve `lookup` / `snapshot_now`; `stop()` writes a final snapshot."""

    def __init__(self, nc: NATS, js: JetStreamContext, settings: IndexSettings, watch: bool = True,
                 registry: CollectorRegistry | None = None) -> None:
        self.nc, self.js, self.settings, self.watch = nc, js, settings, watch
        self.state = IndexState()
        self.metrics = None if registry is None else IndexMetrics.create(
            registry, lambda: float(len(self.state.index)), lambda: float(len(self.state.gaps())),
            lambda: float(self.state.stream_seq))
        self.ready = False
        self.started_at = time.monotonic()
        self.ready_after_s: float | None = None
        self._target_seq = 0
        self.messages_read = 0  # stream messages this replica read (after its snapshot)
        self._since_snapshot = 0
        self._last_snapshot = time.monotonic()
        self._sub = None
        self._dumping: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._snapshot_lock = asyncio.Lock()
        self._snap_task: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------

    async def start(self) -> None:
        await self._restore()
        info = await self.js.stream_info(KV_EVENTS.name)
        first, last = info.state.first_seq, info.state.last_seq
        if self.state.stream_seq > last or (self.state.stream_seq + 1 < first and self.state.feeds):
            # The snapshot is from another stream, or retention dropped events it never saw: every
            # worker may have changed unseen, so every live feed is repaired by a dump.
            log.warning("snapshot and stream disagree; dumping every worker",
                        snapshot_seq=self.state.stream_seq, first=first, last=last)
            self.state.stream_seq = min(self.state.stream_seq, last)
            for feed in self.state.feeds.values():
                feed.gap = not feed.dead
        self._target_seq = last
        config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                    opt_start_seq=self.state.stream_seq + 1)
        # The ordered consumer lives in server memory: after a NATS restart, missed idle heartbeats make
        # nats-py recreate it from the last sequence seen; 1 s heartbeats bound that to a few seconds.
        self._sub = await self.js.subscribe(subjects.KV_EVENTS_ALL, stream=KV_EVENTS.name, cb=self._on_msg,
                                            ordered_consumer=True, config=config, idle_heartbeat=1.0)
        self._check_ready()
        for worker in self.state.gaps():
            self._schedule_dump(worker)
        if self.watch:
            self._tasks.append(asyncio.create_task(self._watch()))
        self._tasks.append(asyncio.create_task(self._snapshot_timer()))

    async def stop(self, write_snapshot: bool = True) -> None:
        await cancel_and_wait([*self._tasks, *self._dumping.values(), *([self._snap_task] if self._snap_task else [])])
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()
        if write_snapshot and self.ready:
            await self.write_snapshot()

    # --- endpoints -----------------------------------------------------

    async def lookup(self, req: LookupRequest) -> LookupReply:
        t0 = time.perf_counter()
        result = self.state.index.lookup(keys_of(req.hashes))
        if self.metrics is not None:
            self.metrics.lookup_seconds.observe(time.perf_counter() - t0)
        return LookupReply.of(result, len(self.state.index), self.ready)

    async def snapshot_now(self, _req: SnapshotRequest) -> SnapshotReply:
        return await self.write_snapshot()

    async def write_snapshot(self) -> SnapshotReply:
        async with self._snapshot_lock:
            t0 = time.perf_counter()
            blob = snapshot.encode(self.state)  # on the loop: the state does not change while encoding
            seq, blocks = self.state.stream_seq, len(self.state.index)
            self._since_snapshot, self._last_snapshot = 0, time.monotonic()
            await snapshot.save(self.js, self.settings.snapshot_name, blob)
            secs = time.perf_counter() - t0
        log.info("index snapshot written", stream_seq=seq, blocks=blocks, bytes=len(blob), seconds=round(secs, 3))
        return SnapshotReply(stream_seq=seq, blocks=blocks, bytes=len(blob), seconds=secs)

    # --- internals -----------------------------------------------------

    async def _restore(self) -> None:
        try:
            blob = await snapshot.load(self.js, self.settings.snapshot_name)
            if blob is None:
                return
            self.state = snapshot.decode(blob)
        except (snapshot.SnapshotError, ObjectReadError) as exc:
            log.warning("index snapshot unusable; replaying the whole stream", error=str(exc))
            self.state = IndexState()
            return
        log.info("index snapshot loaded", stream_seq=self.state.stream_seq, blocks=len(self.state.index))

    async def _on_msg(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        self.messages_read += 1
        try:
            batch = KVEventBatch.from_bytes(msg.data)
        except ProtocolError as exc:
            log.warning("unreadable KV event batch skipped", stream_seq=seq, error=str(exc))
            self.state.stream_seq = max(self.state.stream_seq, seq)
        else:
            if self.state.apply_batch(batch, seq):
                self._schedule_dump(batch.worker)
            self._since_snapshot += len(batch.events)
        self._check_ready()
        if self._since_snapshot >= self.settings.snapshot_every_events and self.ready and (
                self._snap_task is None or self._snap_task.done()):
            self._snap_task = asyncio.create_task(self._safe_snapshot())

    def _check_ready(self) -> None:
        if not self.ready and self.state.stream_seq >= self._target_seq:
            self.ready = True
            self.ready_after_s = time.monotonic() - self.started_at
            log.info("index ready", blocks=len(self.state.index), seconds=round(self.ready_after_s, 3))
            if self.watch:  # only what the replay rebuilt: events applied after this are from live workers
                self._tasks.append(asyncio.create_task(self._purge_absent(set(self.state.index.slots))))

    def _schedule_dump(self, worker: str) -> None:
        if worker not in self._dumping:
            self._dumping[worker] = asyncio.create_task(self._repair(worker))

    async def _repair(self, worker: str) -> None:
        try:
            for attempt in range(_DUMP_ATTEMPTS):
                feed = self.state.feeds.get(worker)
                if feed is None or not feed.gap or feed.dead:
                    return
                try:
                    state = await fetch_dump(self.nc, worker, self.settings.dump_timeout_s)
                except DumpError as exc:
                    log.warning("state dump failed", worker=worker, attempt=attempt, error=str(exc))
                    self._count_dump("failed")
                    await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                    continue
                self._count_dump("ok")
                if not self.state.apply_dump(state):
                    log.info("gap repaired by dump", worker=worker, seq=state.seq, l1=len(state.l1), l2=len(state.l2))
                    return
        finally:
            self._dumping.pop(worker, None)

    def _count_dump(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.dumps.labels(result).inc()

    async def _purge_absent(self, replayed: set[str]) -> None:
        # Workers that died while no replica watched (or before the snapshot) never send a DOWN:
        # whatever the replay rebuilt for a worker without a live heartbeat now is purged. A worker
        # first seen after readiness is left alone: its events arrived while this await ran.
        alive = await alive_workers(self.js)
        for worker in [w for w in replayed if w not in alive and w in self.state.index.slots]:
            self._purge(worker)

    def _purge(self, worker: str) -> None:
        self.state.purge(worker)
        if self.metrics is not None:
            self.metrics.purges.inc()
        log.info("worker purged from the index", worker=worker)

    async def _watch(self) -> None:
        async for change in follow_workers(self.js, updates=True):
            worker, hb = change.worker_id, change.heartbeat
            if change.change is Change.DOWN:
                self._purge(worker)
                continue
            if change.change is Change.UP and self.state.revive(worker):
                self._schedule_dump(worker)  # back under the same id after a purge
            elif self.ready and hb is not None and self._lagging(hb):
                log.warning("feed stuck behind the worker's published events; dumping", worker=worker,
                            published=hb.kv_seq)
                self._schedule_dump(worker)

    def _lagging(self, hb: Heartbeat) -> bool:
        if hb.kv_epoch is None or hb.kv_seq is None:  # not a worker that publishes KV events
            return False
        return self.state.lagging(hb.worker_id, hb.kv_epoch, hb.kv_seq, time.monotonic(), self.settings.lag_grace_s)

    async def _snapshot_timer(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self._last_snapshot + self.settings.snapshot_every_s - time.monotonic()))
            due = time.monotonic() - self._last_snapshot >= self.settings.snapshot_every_s
            if self.ready and self._since_snapshot and due:
                await self._safe_snapshot()

    async def _safe_snapshot(self) -> None:
        try:
            await self.write_snapshot()
        except Exception as exc:  # noqa: BLE001 - the next trigger tries again
            log.warning("index snapshot failed", error=repr(exc))


async def setup_cache_index(ctx: ServiceContext) -> None:
    """The service runner's setup: one replica, its endpoints (queue group), readiness and final snapshot."""
    index = CacheIndex(ctx.nc, ctx.js, ctx.settings.index, registry=ctx.metrics.registry)
    await index.start()
    ctx.add_endpoint(subjects.INDEX_LOOKUP, LookupRequest, index.lookup)
    ctx.add_endpoint(subjects.INDEX_SNAPSHOT, SnapshotRequest, index.snapshot_now)
    ctx.ready_check = lambda: index.ready
    ctx.on_stop.append(index.stop)
