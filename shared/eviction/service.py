"""The eviction service: KV events and heartbeats in; demote / warm commands and L3 deletions out.

It reads the whole KV_EVENTS stream through its own ordered consumer (as
each cache-index replica does) into an `OccupancyView`, watches the
`workers` bucket (a worker going down is forgotten; a worker that started
within `warm_window_s` gets a `Warm` of the hottest L3 chunks), answers
`EVICTION_PIN`, reads the SESSIONS stream (how each agent turn ended) into
its `SessionRetention` planner, whose `Retain`s (a session's chain kept in
L1 until its predicted return, or fetched back just before it) and
ended-session demotions it sends at once, and every `tick_s` sends the
`Advisor`'s demotions and due prefetches to `subjects.commands(worker)`
(stream COMMANDS). A retained chain is also pinned here, so the advisor
never demotes it. Each worker is advised at the L1/L2 sizes its heartbeat
states (the settings' where it states none). Every `gc_interval_s` it
takes the next slice of L3 (`gc_keys_per_pass` keys from a listing, no
request per object: l3_sweep.py), scrubs it (damaged objects go) and
deletes what `plan_gc` picks;
with an `events` publisher it reports the blocks of every chunk it deleted
as `BlockRemoved(L3)`, so the cache index's L3 presence does not go stale.
It only advises: workers never wait for it, and if it is down they evict
locally under their own policy.
All times are unix seconds (L3 metadata and pins are wall-clock).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from datetime import UTC, datetime

from kvmesh.aio import cancel_and_wait
from kvmesh.bus.publish import Publisher
from kvmesh.cache_policy.registry import get_policy
from kvmesh.cache_policy.session import SessionAware
from kvmesh.config import EvictionSettings
from kvmesh.eviction.advisor import Advisor
from kvmesh.eviction.l3_gc import (
    GCLimits,
    GCPlan,
    L3Object,
    apply_gc,
    chunk_pinned,
    plan_gc,
    scrub,
)
from kvmesh.eviction.l3_sweep import L3Sweep, list_chunks
from kvmesh.eviction.messages import (
    Demote,
    PinReply,
    PinRequest,
    Retain,
    Warm,
    WorkerCommand,
)
from kvmesh.eviction.metrics import EvictionMetrics
from kvmesh.eviction.occupancy import OccupancyView
from kvmesh.eviction.pins import PinTable
from kvmesh.eviction.sessions import SessionRetention
from kvmesh.eviction.warmup import plan_warm
from kvmesh.kv_events.events import KVEventBatch
from kvmesh.kv_events.publisher import KVEventPublisher
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.protocol.base import ProtocolError
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.messages import Heartbeat, Role
from kvmesh.protocol.streams import KV_EVENTS, SESSIONS
from kvmesh.service.watch import Change, follow_workers
from kvmesh.sessions.book import BookConfig, SessionBook
from kvmesh.sessions.events import SessionEvent
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.miss import Miss
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from prometheus_client import CollectorRegistry

log = get_logger(__name__)

WARMED_ROLES = (Role.PREFILL, Role.DECODE)


class EvictionService:
    """`start()`, then `pin` serves EVICTION_PIN; `stop()` ends its tasks. `l3=None`: no GC, no warm-up."""

    def __init__(self, nc: NATS, js: JetStreamContext, publisher: Publisher, settings: EvictionSettings,
                 l1_capacity: int, l3: L3Store | None = None, registry: CollectorRegistry | None = None,
                 events: KVEventPublisher | None = None, pins: PinTable | None = None) -> None:
        self.nc, self.js, self.publisher, self.settings, self.l3 = nc, js, publisher, settings, l3
        self.events = events
        if events is not None and l3 is not None:  # what the scrub finds damaged and deletes
            l3.on_quarantined = lambda hashes: events.removed(hashes, Tier.L3)
        self.policy = get_policy(settings.policy)
        self.view = OccupancyView()
        self.pins = PinTable() if pins is None else pins  # no caps unless given (setup.py gives the settings')
        self.advisor = Advisor(self.view, self.pins, self.policy, settings, l1_capacity)
        # One book of sessions for the planner's pins and, with the session-aware policy, the advisor's
        # ranking (which ranks afresh every tick: no re-key sets to collect).
        book = SessionBook(config=BookConfig(track_changes=False))
        if isinstance(self.policy, SessionAware):
            self.policy.book = book
        self.retention = SessionRetention(self.view, book, settings.sessions, l1_capacity)
        self.sweep = None if l3 is None else L3Sweep(l3, settings.gc_keys_per_pass)
        self.l3_objects: list[L3Object] = []  # the most recently accessed chunks seen (bounded): warm-up's pool
        self._verified: set[tuple[str, str]] = set()  # (key, etag) of L3 objects a scrub read intact
        self.sent: list[WorkerCommand] = []  # the latest commands published (bounded), for tests and status
        self.deleted = 0
        self.metrics = None if registry is None else EvictionMetrics.create(
            registry, lambda: float(len(self.pins)), lambda: float(len(self.view.workers)),
            lambda: float(self.sweep.objects_known() if self.sweep is not None else 0), self.retention.counts)
        self._subs: list = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL)
        self._subs.append(await self.js.subscribe(subjects.KV_EVENTS_ALL, stream=KV_EVENTS.name, cb=self._on_events,
                                                  ordered_consumer=True, config=config, idle_heartbeat=1.0))
        if self.settings.sessions.enabled:
            # Only turns that end from now on: an old turn's predicted return is long past.
            fresh = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW)
            self._subs.append(await self.js.subscribe(subjects.SESSION_EVENTS, stream=SESSIONS.name,
                                                      cb=self._on_session_event, ordered_consumer=True,
                                                      config=fresh, idle_heartbeat=1.0))
        self._tasks = [asyncio.create_task(self._every(self.settings.tick_s, self.tick)),
                       asyncio.create_task(self._watch())]
        if self.l3 is not None:
            self._tasks.append(asyncio.create_task(self._every(self.settings.gc_interval_s, self.collect)))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        for sub in self._subs:
            with suppress(Exception):
                await sub.unsubscribe()

    # --- endpoint --------------------------------------------------------

    async def pin(self, req: PinRequest) -> PinReply:
        """A tenant's pin (or release) within its cap and the pool's; a refusal names the cap and the bytes."""
        now = time.time()
        until = now + req.ttl_s
        hashes = [bytes.fromhex(h) for h in req.hashes]
        ledger = self.pins.tenants
        if req.release:
            return PinReply(pinned=self.pins.release(req.tenant, hashes), until=now,
                            used_bytes=ledger.tenant_used(req.tenant))
        g = self.pins.pin_for(req.tenant, hashes, req.block_bytes or self.pins.block_bytes, until, now, req.whole)
        if g.refused is None:
            return PinReply(pinned=g.granted, until=until, used_bytes=ledger.tenant_used(req.tenant),
                            wanted_bytes=g.wanted_bytes)
        tenant = g.refused.value == "tenant"
        log.info("pin refused", tenant=req.tenant, cap=g.refused.value, wanted_bytes=g.wanted_bytes,
                 pinned=g.granted)
        return PinReply(pinned=g.granted, until=until, refused=g.refused.value,
                        cap_bytes=ledger.tenant_cap if tenant else ledger.pool_cap,
                        used_bytes=ledger.tenant_used(req.tenant) if tenant else ledger.used(),
                        wanted_bytes=g.wanted_bytes)

    # --- periodic work -----------------------------------------------------

    async def tick(self) -> None:
        now = time.time()
        self.pins.expire(now)
        self.view.prune(self.settings.max_block_stats)
        for cmd in self.advisor.advise(now):
            await self._send(cmd, reason="watermark")
        for cmd in self.retention.tick(now):  # due prefetches (retains): nothing demoted
            await self._send(cmd)

    async def collect(self) -> GCPlan:
        """One L3 pass over the next slice: list, confirm TTL candidates, scrub, plan, delete."""
        assert self.l3 is not None and self.sweep is not None
        store, sweep, now = self.l3, self.sweep, time.time()
        part = await asyncio.to_thread(sweep.next_slice)
        objects = await asyncio.to_thread(sweep.confirm, part.objects, now)
        s = self.settings
        sweep.prune_verified(self._verified, part)
        damaged = set(await asyncio.to_thread(scrub, store, objects, self._verified, s.scrub_bytes_per_pass))
        objects = [o for o in objects if o.key not in damaged]
        sliced = sweep.keys_per_pass is not None
        limits = GCLimits(capacity_bytes=s.l3_capacity_bytes, namespace_quota_bytes=s.namespace_quota_bytes)
        if sliced and sweep.totals is None:
            limits = GCLimits()  # byte budgets wait for one full cycle's counts: TTL only until then
        pinned = chunk_pinned(store, self.pins, now)

        def accesses(obj: L3Object) -> int:
            info = self.view.stats.get(obj.last_hash)
            return info.access_count if info is not None else 1
        plan = await asyncio.to_thread(plan_gc, objects, limits, self.policy, now, pinned, accesses,
                                       sweep.totals if sliced else None)
        # What the deleted chunks held leaves the L3 view: L2 advice then keeps those blocks (a block
        # also in a surviving chunk is only kept more carefully than needed).
        gone_hashes = await asyncio.to_thread(_toc_hashes, store, plan.keys)
        self.deleted += await asyncio.to_thread(apply_gc, store, plan.keys)
        self.view.l3.difference_update(gone_hashes)
        if self.events is not None:
            self.events.removed(gone_hashes, Tier.L3)
        if self.metrics is not None:
            for reason, keys in (("expired", plan.expired), ("over_quota", plan.over_quota),
                                 ("over_capacity", plan.over_capacity), ("damaged", damaged)):
                self.metrics.l3_deleted.labels(reason).inc(len(keys))
        gone = set(plan.keys)
        kept = [o for o in objects if o.key not in gone]
        sweep.finish(part, kept)
        self._keep_warm_pool(kept, gone | damaged)
        if gone or damaged:
            log.info("L3 gc", expired=len(plan.expired), over_quota=len(plan.over_quota),
                     over_capacity=len(plan.over_capacity), damaged=len(damaged))
        return plan

    def _keep_warm_pool(self, kept: list[L3Object], gone: set[str]) -> None:
        """Merge a slice into warm-up's pool: the most recently accessed chunks, a bounded number."""
        limit = max(1024, 16 * self.settings.warm_max_chunks)
        fresh = {o.key for o in kept}
        pool = [o for o in self.l3_objects if o.key not in gone and o.key not in fresh] + kept
        self.l3_objects = sorted(pool, key=lambda o: o.last_access, reverse=True)[:limit]

    async def warm(self, worker: str, incarnation: str = "") -> WorkerCommand | None:
        """Send `worker` the hottest L3 chunks (scanning L3 first if no scan has run yet).

        `incarnation` (its heartbeat's start time) keeps a restarted worker's warm-up from being
        deduplicated as a repeat of the previous one's.
        """
        if self.l3 is None:
            return None
        if not self.l3_objects:
            try:  # the bucket's first keys, as listed: no request per object
                limit = self.settings.gc_keys_per_pass
                listed = await asyncio.to_thread(lambda: list(list_chunks(self.l3, "", limit)))
                self._keep_warm_pool(listed, set())
            except Exception as exc:  # noqa: BLE001 - L3 down or no bucket yet: no warm-up (degrade, don't fail)
                log.warning("L3 scan for warm-up failed", error=repr(exc))
                return None
        keys = plan_warm(self.l3_objects, self.policy, time.time(), self.settings.warm_max_chunks,
                         self.view.stats.get)
        if not keys:
            return None
        cid = f"warm-{worker}-{incarnation}-{len(keys)}-{keys[0].rsplit('/', 1)[-1]}"
        cmd = WorkerCommand(worker=worker, command_id=cid, command=Warm(keys=keys))
        await self._send(cmd)
        return cmd

    # --- internals ---------------------------------------------------------

    async def _on_events(self, msg: Msg) -> None:
        try:
            batch = KVEventBatch.from_bytes(msg.data)
        except ProtocolError as exc:
            log.warning("unreadable KV event batch skipped", error=str(exc))
            return
        self.view.apply(batch, time.time())

    async def _on_session_event(self, msg: Msg) -> None:
        try:
            ev = SessionEvent.from_bytes(msg.data)
        except ProtocolError as exc:
            log.warning("unreadable session event skipped", error=str(exc))
            return
        for cmd in self.retention.on_event(ev, time.time()):
            await self._send(cmd, reason="session_ended")
        if self.metrics is not None:
            self.metrics.observe_errors(self.retention.counts)
        else:
            self.retention.counts.errors.clear()

    async def _send(self, cmd: WorkerCommand, reason: str = "") -> None:
        """Publish a command; a demotion's blocks are counted under `reason` (why it was decided)."""
        if isinstance(cmd.command, Retain):  # what a worker keeps for a session, the advisor keeps too
            self.pins.pin((bytes.fromhex(h) for h in cmd.command.hashes), cmd.command.until)
        await self.publisher.publish(subjects.commands(cmd.worker), cmd, msg_id=cmd.command_id)
        self.sent = [*self.sent[-255:], cmd]
        if self.metrics is not None:
            self.metrics.commands.labels(cmd.command.kind).inc()
            if isinstance(cmd.command, Demote):
                tier = cmd.command.src.value.lower()
                self.metrics.decided_blocks.labels(tier, reason).inc(len(cmd.command.hashes))

    async def _watch(self) -> None:
        async for change in follow_workers(self.js):
            if change.change is Change.DOWN:
                self.view.forget_worker(change.worker_id)
            elif change.change is Change.UP and change.heartbeat:
                hb = change.heartbeat  # its own tier sizes: advice at its capacity, not the settings'
                self.view.set_capacity(change.worker_id, hb.l1_capacity_blocks, hb.l2_capacity_blocks)
                if not self._fresh(hb):
                    continue
                try:
                    await self.warm(change.worker_id, f"{change.heartbeat.started_at.timestamp():.6f}")
                except Exception as exc:  # noqa: BLE001 - warming is advice: a worker that misses it just starts cold
                    log.warning("warm advice not sent", worker=change.worker_id, error=repr(exc))

    def _fresh(self, hb: Heartbeat | None) -> bool:
        if hb is None or hb.role not in WARMED_ROLES:
            return False
        return (datetime.now(UTC) - hb.started_at).total_seconds() <= self.settings.warm_window_s

    async def _every(self, period_s: float, fn) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await fn()
            except Exception as exc:  # noqa: BLE001 - one failed pass (S3 or NATS down) is retried next period
                log.warning("eviction pass failed", what=fn.__name__, error=repr(exc))


def _toc_hashes(store: L3Store, keys: list[str]) -> set[bytes]:
    out: set[bytes] = set()
    for key in keys:
        out.add(bytes.fromhex(key.rsplit("/", 1)[-1]))
        toc = store.read_toc(key)
        if not isinstance(toc, Miss):
            out.update(h for h, _, _ in toc)
    return out
