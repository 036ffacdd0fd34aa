"""The other workers this one can borrow KV blocks from, kept current from heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from kvmesh.log import get_logger
from kvmesh.protocol.messages import Role
from kvmesh.service.watch import Change, follow_workers
from nats.js import JetStreamContext

log = get_logger(__name__)

_KV_ROLES = frozenset({Role.PREFILL, Role.DECODE})


@dataclass
class PeerDirectory:
    """Worker ids of live prefill/decode workers other than `self_id`, in the order they came up."""

    js: JetStreamContext
    self_id: str
    _peers: dict[str, None] = field(default_factory=dict)
    _task: asyncio.Task | None = None

    def ids(self) -> list[str]:
        return list(self._peers)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="peer-directory")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        async for change in follow_workers(self.js):
            hb = change.heartbeat
            if change.worker_id == self.self_id or hb is None or hb.role not in _KV_ROLES:
                continue
            if change.change is Change.UP:
                self._peers[change.worker_id] = None
            elif change.change is Change.DOWN:
                self._peers.pop(change.worker_id, None)
