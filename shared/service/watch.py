"""Watch the `workers` bucket and yield workers coming up and going down.

A worker is up from its first heartbeat until its entry is deleted (graceful
stop) or expires (no heartbeat within its TTL; the server's expiry marker, or,
should the watcher miss that, no heartbeat here for 1.5 TTLs). A worker that restarts under
the same id (new `started_at`) is reported down, then up: its previous
incarnation's state (cached blocks, in-flight jobs) is gone.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum

import nats.errors
from nats.js import JetStreamContext
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue, StopIterSentinel

from shared.log import get_logger
from shared.protocol import subjects
from shared.protocol.base import ProtocolError
from shared.protocol.messages import Heartbeat

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
    """Yield changes forever, starting with an UP for every worker alive now; close the generator to stop.

    `updates=True` also yields UPDATE for every later heartbeat (load-aware routing reads them).
    """
    kv = await js.key_value(subjects.WORKERS_BUCKET)
    watcher = await kv.watchall()
    alive: dict[str, Heartbeat] = {}
    seen: dict[str, float] = {}  # worker id -> monotonic time its latest heartbeat arrived here
    try:
        while True:
            for change in _sweep(alive, seen):
                yield change
            try:
                entry = await watcher.updates(timeout=_until_next_lapse(alive, seen))
            except nats.errors.TimeoutError:
                continue
            if isinstance(entry, StopIterSentinel):
                return
            if entry is not None:  # None marks the end of the initial snapshot
                for change in _apply(entry, alive, seen, updates):
                    yield change
    finally:
        await watcher.stop()


def _apply(entry: KeyValue.Entry, alive: dict[str, Heartbeat], seen: dict[str, float],
           updates: bool) -> list[WorkerChange]:
    if entry.operation in (KV_DEL, KV_PURGE):
        seen.pop(entry.key, None)
        last = alive.pop(entry.key, None)
        return [WorkerChange(Change.DOWN, entry.key, last)] if last is not None else []
    try:
        hb = Heartbeat.from_bytes(entry.value or b"")
    except ProtocolError as exc:
        log.warning("unreadable heartbeat ignored", key=entry.key, error=str(exc))
        return []
    prev = alive.get(entry.key)
    alive[entry.key], seen[entry.key] = hb, time.monotonic()
    if prev is None:
        return [WorkerChange(Change.UP, entry.key, hb)]
    if prev.started_at != hb.started_at:
        return [WorkerChange(Change.DOWN, entry.key, prev), WorkerChange(Change.UP, entry.key, hb)]
    return [WorkerChange(Change.UPDATE, entry.key, hb)] if updates else []


def _sweep(alive: dict[str, Heartbeat], seen: dict[str, float]) -> list[WorkerChange]:
    # The server's expiry marker is the normal DOWN signal; this catches a marker the watcher
    # never saw (it was disconnected longer than the marker lived) from the heartbeat's own TTL.
    now = time.monotonic()
    lapsed = [wid for wid, hb in alive.items() if now - seen[wid] > hb.ttl_s * LAPSE_FACTOR]
    for wid in lapsed:
        seen.pop(wid)
    return [WorkerChange(Change.DOWN, wid, alive.pop(wid)) for wid in lapsed]


def _until_next_lapse(alive: dict[str, Heartbeat], seen: dict[str, float]) -> float:
    now = time.monotonic()
    waits = [seen[wid] + hb.ttl_s * LAPSE_FACTOR - now for wid, hb in alive.items()]
    return min(_MAX_WAIT_S, max(0.05, min(waits, default=_MAX_WAIT_S)))


async def alive_workers(js: JetStreamContext) -> dict[str, Heartbeat]:
    """A snapshot: worker id -> latest heartbeat of every worker whose entry has not expired."""
    kv = await js.key_value(subjects.WORKERS_BUCKET)
    watcher = await kv.watchall(ignore_deletes=True)
    alive: dict[str, Heartbeat] = {}
    try:
        while (entry := await watcher.updates(timeout=5.0)) is not None:
            try:
                alive[entry.key] = Heartbeat.from_bytes(entry.value or b"")
            except ProtocolError as exc:
                log.warning("unreadable heartbeat ignored", key=entry.key, error=str(exc))
    finally:
        await watcher.stop()
    return alive
