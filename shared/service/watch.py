"""Watch the `workers` bucket and yield workers coming up and going down.

A worker is up from its first heartbeat until its entry is deleted (graceful
stop) or expires (no heartbeat within its TTL). A worker that restarts under
the same id (new `started_at`) is reported down, then up: its previous
incarnation's state (cached blocks, in-flight jobs) is gone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum

from nats.js import JetStreamContext
from nats.js.kv import KV_DEL, KV_PURGE

from shared.log import get_logger
from shared.protocol import subjects
from shared.protocol.base import ProtocolError
from shared.protocol.messages import Heartbeat

log = get_logger(__name__)


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
    try:
        async for entry in watcher:
            if entry is None:  # end of the initial snapshot
                continue
            if entry.operation in (KV_DEL, KV_PURGE):
                last = alive.pop(entry.key, None)
                if last is not None:
                    yield WorkerChange(Change.DOWN, entry.key, last)
                continue
            try:
                hb = Heartbeat.from_bytes(entry.value or b"")
            except ProtocolError as exc:
                log.warning("unreadable heartbeat ignored", key=entry.key, error=str(exc))
                continue
            prev = alive.get(entry.key)
            alive[entry.key] = hb
            if prev is not None and prev.started_at != hb.started_at:
                yield WorkerChange(Change.DOWN, entry.key, prev)
                yield WorkerChange(Change.UP, entry.key, hb)
            elif prev is None:
                yield WorkerChange(Change.UP, entry.key, hb)
            elif updates:
                yield WorkerChange(Change.UPDATE, entry.key, hb)
    finally:
        await watcher.stop()


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
