"""Heartbeats in the `workers` bucket and the up/down watcher."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from bus.helpers import connected, unique
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol import subjects
from kvmesh.protocol.messages import Role
from kvmesh.service.heartbeat import HeartbeatLoop
from kvmesh.service.watch import (
    Change,
    WorkerChange,
    alive_workers,
    follow_workers,
    watch_workers,
)
from nats.aio.msg import Msg
from nats.js import api
from waits import until


async def _next_for(changes: AsyncIterator[WorkerChange], worker_id: str, timeout_s: float) -> WorkerChange:
    """The next change of `worker_id` (the session server also holds other tests' workers)."""

    async def find() -> WorkerChange:
        async for change in changes:
            if change.worker_id == worker_id:
                return change
        raise AssertionError("watcher ended")

    return await asyncio.wait_for(find(), timeout_s)


@dataclass
class _KeyLog:
    """Every message of one worker's key, as the server stored it: heartbeats, deletes, expiry markers.

    Its headers say what each was (`Nats-TTL` on a heartbeat, `KV-Operation: DEL` on a delete,
    `Nats-Marker-Reason: MaxAge` on the marker the server leaves when the TTL ran out) and its
    metadata when the server stored it.
    """

    msgs: list[Msg] = field(default_factory=list)
    _sub: object = None

    @classmethod
    async def follow(cls, js, worker_id: str) -> _KeyLog:
        log = cls()
        log._sub = await js.subscribe(subjects.heartbeat_key(worker_id), cb=log._on_msg, ordered_consumer=True,
                                      config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL))
        return log

    async def _on_msg(self, msg: Msg) -> None:
        self.msgs.append(msg)

    def heartbeats(self) -> list[Msg]:
        return [m for m in self.msgs if m.data]

    def after_last_heartbeat(self) -> Msg | None:
        """What the server stored after the latest heartbeat (None yet: nothing)."""
        last = max((i for i, m in enumerate(self.msgs) if m.data), default=-1)
        return self.msgs[last + 1] if 0 <= last < len(self.msgs) - 1 else None

    async def close(self) -> None:
        await self._sub.unsubscribe()


def _stored_apart_s(earlier: Msg, later: Msg) -> float:
    """Seconds between two messages by the server's own timestamps (not a clock of the test's)."""
    return (later.metadata.timestamp - earlier.metadata.timestamp).total_seconds()


def _beater(js, worker_id: str, load: float = 0.0, ttl_s: float = 2.0) -> HeartbeatLoop:
    return HeartbeatLoop(js, worker_id, Role.DECODE, "http://127.0.0.1:1", interval_s=0.3, ttl_s=ttl_s,
                         metrics=ServiceMetrics.create("test"), load=lambda: load, capacity=8)


async def test_stopped_heartbeat_expires_and_watcher_sees_it(nats_server):
    worker = unique("w")
    async with connected(nats_server.url) as nc:
        js = nc.jetstream()
        changes = watch_workers(js)
        written = await _KeyLog.follow(js, worker)
        beater = _beater(js, worker, load=3)
        task = asyncio.create_task(beater.run())
        up = await _next_for(changes, worker, 5)
        assert up.change is Change.UP and up.heartbeat.load == 3 and up.heartbeat.capacity == 8
        await asyncio.wait_for(_until_seq(beater, 3), 5)  # keeps beating; no repeated UP for the same worker
        beater.stop()  # what a crash looks like: no more writes, no delete
        await task
        down = await _next_for(changes, worker, 8)
        assert down.change is Change.DOWN and down.heartbeat.seq >= 3

        async def gone() -> bool:  # the watcher may call a lapse before the server's expiry lands
            return worker not in await alive_workers(js)

        await until(gone, 10, f"{worker} gone from the bucket")
        # Expired by its 2 s TTL, not removed early: what follows the last heartbeat is the server's
        # expiry marker (not a delete), stored a whole TTL after that heartbeat by the server's clock.
        marker = await until(written.after_last_heartbeat, 10, "what the server stored after the last heartbeat")
        last = written.heartbeats()[-1]
        assert last.headers.get("Nats-TTL") == "2"
        assert marker.headers.get("Nats-Marker-Reason") == "MaxAge" and "KV-Operation" not in marker.headers
        assert _stored_apart_s(last, marker) >= beater.ttl_s
        await written.close()
        await changes.aclose()


async def test_graceful_withdraw_and_restart_are_seen(nats_server):
    worker = unique("w")
    async with connected(nats_server.url) as nc:
        js = nc.jetstream()
        changes = watch_workers(js)
        written = await _KeyLog.follow(js, worker)
        first = _beater(js, worker)
        await first.beat()
        assert (await _next_for(changes, worker, 5)).change is Change.UP
        assert (await alive_workers(js))[worker].started_at == first.started_at
        # Same id, new process: new started_at. Its TTL is far beyond the waits below, so the watcher
        # can only see it go by the delete (a lapse would take 1.5 x 60 s).
        second = _beater(js, worker, ttl_s=60.0)
        await second.beat()
        restart = [await _next_for(changes, worker, 5), await _next_for(changes, worker, 5)]
        assert [c.change for c in restart] == [Change.DOWN, Change.UP]
        assert restart[1].heartbeat.started_at == second.started_at
        await second.withdraw()
        assert (await _next_for(changes, worker, 10)).change is Change.DOWN
        assert worker not in await alive_workers(js)
        # Deleted, not expired: a delete follows its last heartbeat, stored while that one's TTL still ran.
        deleted = await until(written.after_last_heartbeat, 10, "what the server stored after the last heartbeat")
        last = written.heartbeats()[-1]
        assert last.headers.get("Nats-TTL") == "60"
        assert deleted.headers.get("KV-Operation") == "DEL" and "Nats-Marker-Reason" not in deleted.headers
        assert _stored_apart_s(last, deleted) < second.ttl_s
        await written.close()
        await changes.aclose()


async def _until_seq(beater: HeartbeatLoop, seq: int) -> None:
    while beater.seq < seq:
        await asyncio.sleep(0.05)


async def test_updates_and_a_lapse_without_expiry_marker(nats_server):
    worker = unique("w")
    async with connected(nats_server.url) as nc:
        js = nc.jetstream()
        changes = watch_workers(js, updates=True)
        beater = _beater(js, worker, load=1)
        await beater.beat()
        assert (await _next_for(changes, worker, 5)).change is Change.UP
        beater.load = lambda: 5.0
        await beater.beat()
        update = await _next_for(changes, worker, 5)
        assert update.change is Change.UPDATE and update.heartbeat.load == 5.0 and update.heartbeat.seq == 2

        # An entry the server keeps for 30 s but whose heartbeat says 1 s: as if the expiry marker was missed.
        stale = beater.current().model_copy(update={"ttl_s": 1.0, "seq": 3})
        await js.publish(subjects.heartbeat_key(worker), stale.to_bytes(), msg_ttl=30)
        assert (await _next_for(changes, worker, 5)).change is Change.UPDATE
        t0 = time.monotonic()
        down = await _next_for(changes, worker, 5)
        assert down.change is Change.DOWN and down.heartbeat.seq == 3
        assert time.monotonic() - t0 >= 1.0  # 1.5 x its 1 s TTL after it arrived
        await beater.withdraw()
        await changes.aclose()


async def test_follow_survives_a_nats_restart_and_reports_who_died_meanwhile(fresh_nats_server):
    stays, dies, joins = unique("stays"), unique("dies"), unique("joins")
    async with connected(fresh_nats_server.url) as nc:
        js = nc.jetstream()
        changes = follow_workers(js, retry_s=0.2)
        staying, dying = _beater(js, stays, ttl_s=5.0), _beater(js, dies, ttl_s=1.0)
        tasks = [asyncio.create_task(b.run()) for b in (staying, dying)]
        seen = [await _next_of(changes, {stays, dies}, 5) for _ in range(2)]
        assert {(c.worker_id, c.change) for c in seen} == {(stays, Change.UP), (dies, Change.UP)}

        fresh_nats_server.stop()  # the watch breaks; `dies` crashes while NATS is away
        dying.stop()
        fresh_nats_server.start()
        down = await _next_of(changes, {stays, dies}, 20)
        assert (down.worker_id, down.change) == (dies, Change.DOWN)  # and no second UP for `stays`

        late = _beater(js, joins)
        await late.beat()
        assert (await _next_of(changes, {stays, dies, joins}, 10)).change is Change.UP  # the watch runs again
        staying.stop()
        await asyncio.gather(*tasks)
        await changes.aclose()


async def _next_of(changes: AsyncIterator[WorkerChange], workers: set[str], timeout_s: float) -> WorkerChange:
    """The next change of any of `workers`."""

    async def find() -> WorkerChange:
        async for change in changes:
            if change.worker_id in workers:
                return change
        raise AssertionError("follow ended")

    return await asyncio.wait_for(find(), timeout_s)


async def test_workers_started_together_do_not_beat_in_lockstep(nats_server):
    """Their second beats land at random phases of the interval, not in one burst a watcher must take at once."""
    workers = [unique("phase") for _ in range(16)]
    async with connected(nats_server.url) as nc:
        js = nc.jetstream()
        changes = watch_workers(js, updates=True)
        beaters = [HeartbeatLoop(js, w, Role.DECODE, "http://127.0.0.1:1", interval_s=1.0, ttl_s=3.0,
                                 metrics=ServiceMetrics.create("test")) for w in workers]
        tasks = [asyncio.create_task(b.run()) for b in beaters]
        second: dict[str, float] = {}

        async def collect() -> None:
            async for change in changes:
                if change.worker_id in workers and change.heartbeat and change.heartbeat.seq == 2:
                    second[change.worker_id] = time.monotonic()
                    if len(second) == len(workers):
                        return

        await asyncio.wait_for(collect(), 10)
        for b in beaters:
            b.stop()
        await asyncio.gather(*tasks)
        await changes.aclose()
    # All at one phase, the spread is the few ms their first beats took; 16 uniform phases all within
    # 0.25 s of each other happen with probability < 1e-8.
    assert max(second.values()) - min(second.values()) > 0.25


async def test_an_unchanged_heartbeat_is_written_again_only_at_its_keepalive(nats_server):
    worker = unique("w")
    load, position = [1.0], [(1, 0)]
    async with connected(nats_server.url) as nc:
        beater = HeartbeatLoop(nc.jetstream(), worker, Role.PREFILL, "http://127.0.0.1:1", interval_s=0.3,
                               ttl_s=3.0, metrics=ServiceMetrics.create("test"), load=lambda: load[0],
                               kv_position=lambda: position[0])
        assert beater.keepalive_s == 1.0  # a third of the TTL
        assert beater.due(time.monotonic())  # nothing written yet
        t0 = time.monotonic()
        await beater.beat()
        assert not beater.due(t0 + 0.5)  # unchanged, keep-alive not due
        assert beater.due(time.monotonic() + 1.0)
        load[0] = 2.0
        assert beater.due(t0 + 0.5)  # the load moved
        await beater.beat()
        assert not beater.due(time.monotonic())
        position[0] = (1, 7)  # KV events were published: the index must hear of it
        assert beater.due(time.monotonic())
        await beater.withdraw()
        slow = HeartbeatLoop(nc.jetstream(), worker, Role.DECODE, "http://127.0.0.1:1", interval_s=2.0, ttl_s=3.0,
                             metrics=ServiceMetrics.create("test"))
        assert slow.keepalive_s == 2.0  # never more often than the interval


async def test_load_moves_within_an_interval_while_idle_beats_slow_to_the_keepalive(nats_server):
    worker = unique("w")
    load = [1.0]
    async with connected(nats_server.url) as nc:
        js = nc.jetstream()
        changes = watch_workers(js, updates=True)
        beater = HeartbeatLoop(js, worker, Role.DECODE, "http://127.0.0.1:1", interval_s=0.2, ttl_s=3.0,
                               metrics=ServiceMetrics.create("test"), load=lambda: load[0])
        task = asyncio.create_task(beater.run())
        assert (await _next_for(changes, worker, 5)).change is Change.UP
        load[0] = 5.0
        while (change := await _next_for(changes, worker, 5)).heartbeat.load != 5.0:
            pass  # a keep-alive written before the load moved
        arrivals = []
        for _ in range(3):  # idle now: keep-alives only
            change = await _next_for(changes, worker, 5)
            assert change.change is Change.UPDATE and change.heartbeat.load == 5.0
            arrivals.append(time.monotonic())
        beater.stop()
        await task
        await beater.withdraw()
        await changes.aclose()
    # Written every look, they would arrive 0.2 s apart; keep-alives are 1 s apart (a delayed
    # delivery can shorten one gap, never both).
    assert max(b - a for a, b in itertools.pairwise(arrivals)) > 0.6
