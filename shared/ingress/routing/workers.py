"""The live workers as this ingress sees them: heartbeats plus its own in-flight count per worker.

`WorkerTable` mirrors the `workers` heartbeat bucket (via `follow_workers`)
and adds the ingress's own in-flight count per worker, which moves at once
while heartbeats lag by an interval.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvmesh.aio import wait_event
from kvmesh.log import get_logger
from kvmesh.protocol.messages import Heartbeat, Role
from kvmesh.service.watch import Change, WorkerChange, follow_workers
from nats.js import JetStreamContext

log = get_logger(__name__)


@dataclass(slots=True)
class WorkerView:
    heartbeat: Heartbeat
    in_flight: int = 0  # requests this ingress has on the worker now
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set when its heartbeat is withdrawn or expires

    def score(self) -> float:
        return self.queued() / max(self.heartbeat.capacity, 1.0)

    def queued(self) -> float:
        return self.heartbeat.load + self.in_flight


class WorkerTable:
    """Live workers by id; fed by `run(js)` (or `apply` in tests).

    `version` moves whenever the membership does (a worker up, down, or in another role), so the
    router keeps what depends only on who is live (sorted lists, affinity homes) until it moves:
    at 1,000 workers a heartbeat arrives every millisecond, a membership change rarely.
    """

    __slots__ = ("_workers", "_changed", "_live", "_queued", "version")

    def __init__(self) -> None:
        self._workers: dict[str, WorkerView] = {}
        self._changed = asyncio.Event()
        self._live: dict[Role, list[str]] = {}  # sorted ids per role, for this version
        self._queued: dict[Role, float] = {}  # sum of `queued()` over the role's live workers, kept as they change
        self.version = 0

    def apply(self, change: WorkerChange) -> None:
        if change.change is Change.DOWN:
            view = self._workers.pop(change.worker_id, None)
            if view is not None:
                view.gone.set()
                self._moved()
                log.info("worker down", worker=change.worker_id, role=view.heartbeat.role)
        elif change.heartbeat is not None:
            view = self._workers.get(change.worker_id)
            if view is None:
                self._workers[change.worker_id] = WorkerView(change.heartbeat)
                self._moved()
                log.info("worker up", worker=change.worker_id, role=change.heartbeat.role)
            elif view.heartbeat.role != change.heartbeat.role:
                view.heartbeat = change.heartbeat
                self._moved()
            else:
                role = view.heartbeat.role
                self._queued[role] = self._queued.get(role, 0.0) + change.heartbeat.load - view.heartbeat.load
                view.heartbeat = change.heartbeat
        self._changed.set()

    def _moved(self) -> None:
        self.version += 1
        self._live.clear()
        self._queued = {}  # summed afresh (no float drift survives a membership change)
        for view in self._workers.values():
            role = view.heartbeat.role
            self._queued[role] = self._queued.get(role, 0.0) + view.queued()

    def queued_total(self, role: Role) -> float:
        """Heartbeat load + this ingress's in-flight, summed over the live workers of `role`."""
        return self._queued.get(role, 0.0)

    async def run(self, js: JetStreamContext) -> None:
        """Follow the bucket until cancelled."""
        async for change in follow_workers(js, updates=True):
            self.apply(change)

    def live(self, role: Role) -> list[str]:
        return list(self.live_ids(role))

    def live_ids(self, role: Role) -> list[str]:
        """The sorted ids of live `role` workers; shared until the membership moves: do not modify."""
        ids = self._live.get(role)
        if ids is None:
            ids = self._live[role] = sorted(w for w, v in self._workers.items() if v.heartbeat.role == role)
        return ids

    def view(self, worker_id: str) -> WorkerView | None:
        return self._workers.get(worker_id)

    def gone(self, worker_id: str) -> asyncio.Event:
        """An event set once `worker_id` is down (already set if it is not live now)."""
        view = self._workers.get(worker_id)
        if view is None:
            done = asyncio.Event()
            done.set()
            return done
        return view.gone

    def acquire(self, worker_id: str) -> None:
        if (view := self._workers.get(worker_id)) is not None:
            view.in_flight += 1
            role = view.heartbeat.role
            self._queued[role] = self._queued.get(role, 0.0) + 1

    def release(self, worker_id: str) -> None:
        if (view := self._workers.get(worker_id)) is not None and view.in_flight > 0:
            view.in_flight -= 1
            role = view.heartbeat.role
            self._queued[role] = self._queued.get(role, 0.0) - 1

    async def wait_for(self, role: Role, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a live worker of `role`; True if there is one."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while not self.live(role):
            left = end - loop.time()
            if left <= 0:
                return False
            self._changed.clear()
            if not await wait_event(self._changed, left):
                return False
        return True
