"""Watch the `workers` bucket and yield workers coming up and going down.

A worker is up from its first heartbeat until its entry is deleted (graceful
stop) or expires (no heartbeat within its TTL; the server's expiry marker, or,
should the watcher miss that, no heartbeat here for 1.5 TTLs, confirmed by
reading the bucket: a watch whose consumer vanished in a NATS restart goes
silent rather than failing, and must not declare the whole fleet down). A
worker that restarts under the same id (new `started_at`) is reported down,
then up: its previous incarnation's state (cached blocks, in-flight jobs) is
gone.

`watch_workers` ends with the watch (NATS gone, connection closed);
`follow_workers` is what long-lived services use: it restarts a broken watch
and reconciles across the gap, so a worker that died meanwhile is still
reported down and one that stayed up is not reported up twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum

import nats.errors
import nats.js.errors
from kvmesh.aio import next_within
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.protocol.base import ProtocolError
from kvmesh.protocol.messages import Heartbeat
from nats.js import JetStreamContext
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

log = get_logger(__name__)

LAPSE_FACTOR = 1.5  # no heartbeat for this many TTLs: down, even if no expiry marker arrived
_MAX_WAIT_S = 5.0


class Change(StrEnum):
    UP = "up"
    DOWN = "down"
    UPDATE = "update"  # a new heartbeat of a worker already up (only with updates=True)


@dataclass(frozen=True, slots=True)
class WorkerChange:
    change: Change
    worker_id: str
    heartbeat: Heartbeat | None  # the latest one seen (None if the worker was never seen up)


async def watch_workers(js: JetStreamContext, updates: bool = False) -> AsyncIterator[WorkerChange]:
    """Yield changes until the watch ends or fails, starting with an UP for every worker alive now.

    `updates=True` also yields UPDATE for every later heartbeat (load-aware routing reads them).
    Raises `StaleWatch` when the bucket holds heartbeats the watch never delivered.
    """
    kv = await js.key_value(subjects.WORKERS_BUCKET)
    watcher = await kv.watchall()
    alive: dict[str, Heartbeat] = {}
    seen = _Seen()
    try:
        while True:
            if lapsed := seen.lapsed(time.monotonic()):
                await _confirm_lapsed(kv, lapsed, seen)
                for wid in lapsed:
                    seen.forget(wid)
                    yield WorkerChange(Change.DOWN, wid, alive.pop(wid))
            try:
                entry = await next_within(watcher, seen.until_next_lapse(time.monotonic()))
            except TimeoutError:
                continue
            except StopAsyncIteration:
                return
            if entry is not None:  # None marks the end of the initial snapshot
                for change in _apply(entry, alive, seen, updates):
                    yield change
    finally:
        await _stop(watcher)


class StaleWatch(ConnectionError):
    """The watch stopped delivering (its consumer was lost, e.g. in a NATS restart) without saying so."""


class _Seen:
    """When each live worker's latest heartbeat arrived here, and when it lapses without another.

    Lapse deadlines sit in a heap; a newer heartbeat leaves its predecessor's entry behind, dropped
    when it reaches the top. So a heartbeat costs O(log n) and the next lapse is read off the top:
    at 1,000 workers beating every second, scanning every worker per heartbeat was 10^6 steps/s.
    """

    __slots__ = ("_latest", "_revision", "_deadlines", "_count")

    def __init__(self) -> None:
        self._latest: dict[str, int] = {}  # worker -> number of its latest heartbeat here (its live heap entry)
        self._revision: dict[str, int] = {}  # that heartbeat's sequence in the bucket's stream
        self._deadlines: list[tuple[float, str, int]] = []  # (lapse time, worker, heartbeat number)
        self._count = 0

    def saw(self, wid: str, revision: int, ttl_s: float, now: float) -> None:
        self._count += 1
        self._latest[wid], self._revision[wid] = self._count, revision
        heapq.heappush(self._deadlines, (now + ttl_s * LAPSE_FACTOR, wid, self._count))

    def forget(self, wid: str) -> None:
        self._latest.pop(wid, None)  # its heap entries go stale
        self._revision.pop(wid, None)

    def revision(self, wid: str) -> int:
        return self._revision[wid]

    def lapsed(self, now: float) -> list[str]:
        """Workers with no heartbeat since their deadline; each is reported once (until seen again).

        The server's expiry marker is the normal DOWN signal; this catches a marker the watcher never
        saw (it was disconnected longer than the marker lived), from the heartbeat's own TTL.
        """
        out: list[str] = []
        while self._deadlines and self._deadlines[0][0] < now:
            _, wid, n = heapq.heappop(self._deadlines)
            if self._latest.get(wid) == n:
                out.append(wid)
        return out

    def until_next_lapse(self, now: float) -> float:
        heap = self._deadlines
        while heap and self._latest.get(heap[0][1]) != heap[0][2]:
            heapq.heappop(heap)
        return min(_MAX_WAIT_S, max(0.05, heap[0][0] - now if heap else _MAX_WAIT_S))


async def follow_workers(js: JetStreamContext, updates: bool = False,
                         retry_s: float = 1.0) -> AsyncIterator[WorkerChange]:
    """Like `watch_workers`, but forever: a failed watch is restarted after `retry_s`.

    On each restart the workers reported up before are checked against the bucket:
    those gone are reported DOWN, those still there under the same incarnation are
    not reported UP again (UPDATE with `updates=True`), a new incarnation is DOWN+UP.
    """
    up: dict[str, Heartbeat] = {}
    restart = False
    while True:
        try:
            if restart:
                alive = await alive_workers(js)
                for wid in [w for w in up if w not in alive]:
                    yield WorkerChange(Change.DOWN, wid, up.pop(wid))
            async for change in watch_workers(js, updates):
                for out in _reconcile(change, up, updates):
                    yield out
        except Exception as exc:  # noqa: BLE001 - NATS away or the watch broke: watch again
            log.warning("worker watch failed; restarting", error=repr(exc))
        restart = True
        await asyncio.sleep(retry_s)


def _reconcile(change: WorkerChange, up: dict[str, Heartbeat], updates: bool) -> list[WorkerChange]:
    wid, hb = change.worker_id, change.heartbeat
    if change.change is Change.DOWN or hb is None:
        up.pop(wid, None)
        return [change]
    prev, up[wid] = up.get(wid), hb
    if change.change is Change.UPDATE or prev is None:
        return [change]
    if prev.started_at == hb.started_at:  # up before the watch broke and still the same incarnation
        return [WorkerChange(Change.UPDATE, wid, hb)] if updates else []
    return [WorkerChange(Change.DOWN, wid, prev), WorkerChange(Change.UP, wid, hb)]


async def _stop(watcher: KeyValue.KeyWatcher) -> None:
    # On a dead connection stop() raises; that must not replace what is unwinding the
    # generator (a CancelledError swallowed here leaves its task running forever).
    with contextlib.suppress(nats.errors.Error, OSError):
        await watcher.stop()


def _apply(entry: KeyValue.Entry, alive: dict[str, Heartbeat], seen: _Seen,
           updates: bool) -> list[WorkerChange]:
    if entry.operation in (KV_DEL, KV_PURGE):
        seen.forget(entry.key)
        last = alive.pop(entry.key, None)
        return [WorkerChange(Change.DOWN, entry.key, last)] if last is not None else []
    try:
        hb = Heartbeat.from_bytes(entry.value or b"")
    except ProtocolError as exc:
        log.warning("unreadable heartbeat ignored", key=entry.key, error=str(exc))
        return []
    prev = alive.get(entry.key)
    alive[entry.key] = hb
    seen.saw(entry.key, entry.revision or 0, hb.ttl_s, time.monotonic())
    if prev is None:
        return [WorkerChange(Change.UP, entry.key, hb)]
    if prev.started_at != hb.started_at:
        return [WorkerChange(Change.DOWN, entry.key, prev), WorkerChange(Change.UP, entry.key, hb)]
    return [WorkerChange(Change.UPDATE, entry.key, hb)] if updates else []


async def _confirm_lapsed(kv: KeyValue, lapsed: list[str], seen: _Seen) -> None:
    """Raise `StaleWatch` if the bucket has a newer heartbeat of any `lapsed` worker than the watch gave."""
    for wid in lapsed:
        try:
            latest = await kv.get(wid)
        except nats.js.errors.KeyNotFoundError:
            continue  # expired or deleted: down indeed
        if (latest.revision or 0) > seen.revision(wid):
            raise StaleWatch(f"the bucket holds heartbeats of {wid} that the watch never delivered")


async def alive_workers(js: JetStreamContext) -> dict[str, Heartbeat]:
    """A snapshot: worker id -> latest heartbeat of every worker whose entry has not expired."""
    kv = await js.key_value(subjects.WORKERS_BUCKET)
    watcher = await kv.watchall(ignore_deletes=True)
    alive: dict[str, Heartbeat] = {}
    try:
        while (entry := await next_within(watcher, 5.0)) is not None:
            try:
                alive[entry.key] = Heartbeat.from_bytes(entry.value or b"")
            except ProtocolError as exc:
                log.warning("unreadable heartbeat ignored", key=entry.key, error=str(exc))
    except StopAsyncIteration:
        raise StaleWatch("the heartbeat watch ended before its snapshot did") from None
    finally:
        await _stop(watcher)
    return alive
