"""Asynchronous L3 writes with bounded memory, retries and backoff.

The producer is a worker's step loop: `submit` never waits. When the queued
bytes would pass `max_bytes` the chain is dropped and counted (`dropped`):
stalling serving for object storage would turn an L3 outage into a serving
outage, while a dropped upload only costs a recompute later. Queued chains are
retried with capped exponential backoff until they land, so an S3 restart
loses nothing that was queued; while the circuit is open each retry fails
fast, and the first retry after the breaker's reset time is its probe.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.tiers.handle import BlockHandle
from shared.tiers.l3_store import L3Store, L3Unavailable


@dataclass(slots=True)
class UploadStats:
    submitted: int = 0
    uploaded: int = 0
    dropped: int = 0
    dropped_bytes: int = 0
    retries: int = 0
    failed: int = 0  # rejected for a reason retrying cannot fix (a bug, bad input): dropped


@dataclass(slots=True)
class _Item:
    namespace: str
    chain: list
    nbytes: int


@dataclass
class UploadQueue:
    store: L3Store
    max_bytes: int
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 1.0
    stats: UploadStats = field(default_factory=UploadStats)
    queued_bytes: int = field(default=0, init=False)
    on_uploaded: Callable[[list[BlockHandle]], None] | None = None  # e.g. publish L3 presence to the index
    _items: deque = field(default_factory=deque, init=False, repr=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    _idle: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    _task: asyncio.Task | None = field(default=None, init=False, repr=False)

    def submit(self, namespace: str, chain: list) -> bool:
        """Queue a chain of encoded blocks (position 0 first); False = dropped, queue full."""
        nbytes = sum(memoryview(b).nbytes for b in chain)
        self.stats.submitted += 1
        if self.queued_bytes + nbytes > self.max_bytes:
            self.stats.dropped += 1
            self.stats.dropped_bytes += nbytes
            return False
        self._items.append(_Item(namespace, chain, nbytes))
        self.queued_bytes += nbytes
        self._idle.clear()
        self._wake.set()
        return True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="l3-upload")

    async def join(self, timeout_s: float) -> bool:
        """Wait until everything queued has landed; False on timeout."""
        if not self._items:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            if not self._items:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            item = self._items[0]
            handles = await self._upload(item)
            self._items.popleft()
            self.queued_bytes -= item.nbytes
            if handles is None:
                continue
            self.stats.uploaded += 1
            if self.on_uploaded is not None:
                self.on_uploaded(handles)

    async def _upload(self, item: _Item) -> list[BlockHandle] | None:
        """Retry until S3 takes the chain; None if the chain itself is bad (counted as failed)."""
        backoff = self.backoff_initial_s
        while True:
            try:
                return await asyncio.to_thread(self.store.put_chain, item.namespace, item.chain)
            except L3Unavailable:
                self.stats.retries += 1
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
            except Exception:  # noqa: BLE001 - one bad chain must not stop the uploader
                self.stats.failed += 1
                return None
