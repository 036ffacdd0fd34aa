"""The worker side of KV events: an `EventLog` published to KV_EVENTS, and the state-dump responder.

`KVEventPublisher` is the engine's `KVEventListener` (it forwards to its
log, so it can be handed to `PrefixCache(listener=...)`) and takes L2/L3
changes through `stored` / `removed` / `moved`. A flush task publishes the
log's batches every `flush_interval_s`; a failed publish keeps its events for
the next try (the msg id names the seq range, so the stream drops a batch it
already has and the index skips seqs it has seen).

Wiring in a worker's setup (before the engine starts storing blocks):

    events = KVEventPublisher(ctx.publisher, ctx.worker_id, ctx.settings.index)
    prefix_cache.listener = events                      # L1
    await events.start(ctx.nc)                          # WorkerCleared, flush task, dump responder
    ctx.on_stop.append(events.stop)
    events.stored(hashes, Tier.L2); events.moved(hashes, Tier.L2, Tier.L3)  # from the tier code
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from kvmesh.aio import wait_event
from kvmesh.bus.publish import Publisher
from kvmesh.config import IndexSettings
from kvmesh.kv_events.dump import WorkerState, serve_dump
from kvmesh.kv_events.event_log import EventLog, Source
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.protocol.block_hash import BlockHash
from kvmesh.protocol.blocks import Tier
from kvmesh.retry import Backoff
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

log = get_logger(__name__)

_MAX_RETRY_WAIT_S = 2.0  # a failed batch is retried at most this far apart (the events wait in the log)


class KVEventPublisher:
    """See the module docstring. `source` (optional) reads the worker's real L1/L2 for dumps;
    without it a dump answers from the log's record of the events it sent."""

    def __init__(self, publisher: Publisher, worker_id: str, settings: IndexSettings,
                 source: Source | None = None, epoch: int | None = None) -> None:
        self.publisher, self.settings, self.source = publisher, settings, source
        self.log = EventLog(worker_id, settings.max_batch_hashes, settings.max_pending_hashes,
                            on_pending=self._on_pending, **({"epoch": epoch} if epoch is not None else {}))
        self.published_batches = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._dump_sub: Subscription | None = None

    @property
    def worker_id(self) -> str:
        return self.log.worker_id

    # --- what the worker calls ------------------------------------------

    def block_stored(self, block_hash: BlockHash, parent_hash: BlockHash | None, num_tokens: int) -> None:
        self.log.block_stored(block_hash, parent_hash, num_tokens)

    def block_removed(self, block_hash: BlockHash) -> None:
        self.log.block_removed(block_hash)

    def stored(self, hashes: Iterable[bytes], tier: Tier, parent: bytes | None = None,
               tokens_per_block: int = 1, session_id: str | None = None) -> None:
        self.log.stored(hashes, tier, parent, tokens_per_block, session_id)

    def removed(self, hashes: Iterable[bytes], tier: Tier) -> None:
        self.log.removed(hashes, tier)

    def moved(self, hashes: Iterable[bytes], src: Tier, dst: Tier) -> None:
        self.log.moved(hashes, src, dst)

    def cleared(self) -> None:
        self.log.cleared()

    def state_dump(self) -> WorkerState:
        return self.log.state_dump(self.source)

    def position(self) -> tuple[int, int]:
        """(epoch, seq): every event of this epoch up to seq is in the stream; heartbeats carry it."""
        return self.log.epoch, self.log.published_seq

    # --- lifecycle -------------------------------------------------------

    async def start(self, nc: NATS) -> None:
        """Begin the epoch (`WorkerCleared`), start flushing and answering dumps."""
        self._loop = asyncio.get_running_loop()
        if self.log.seq == 0:
            self.log.cleared()
        self._dump_sub = await serve_dump(nc, self.worker_id, self.state_dump)
        self._task = asyncio.create_task(self._flush_loop())

    async def stop(self) -> None:
        """Publish what is pending (bounded by the publish retry budget), stop answering dumps."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        if self._dump_sub is not None:
            await self._dump_sub.unsubscribe()

    async def flushed(self, timeout_s: float = 10.0) -> None:
        """Wait until every event recorded so far is in the stream."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while len(self.log):
            if loop.time() > end:
                raise TimeoutError(f"{len(self.log)} KV events of {self.worker_id} not published in {timeout_s}s")
            await asyncio.sleep(self.settings.flush_interval_s)

    # --- internals -------------------------------------------------------

    def _on_pending(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    async def _flush_loop(self) -> None:
        backoff = Backoff(self.settings.flush_interval_s, max(self.settings.flush_interval_s, _MAX_RETRY_WAIT_S))
        while True:
            self._wake.clear()  # before taking: a change recorded after this sets it again
            batch = self.log.take_batch()
            if batch is None:
                if self._stopping:
                    return
                await wait_event(self._wake, 1.0)
                await asyncio.sleep(self.settings.flush_interval_s)  # let a burst gather into one batch
                continue
            try:
                await self.publisher.publish(subjects.kv_events(self.worker_id), batch, batch.msg_id())
            except Exception as exc:  # noqa: BLE001 - keep the events; retry after a pause
                log.warning("kv events publish failed", worker_id=self.worker_id, error=repr(exc))
                if self._stopping:
                    return
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            self.published_batches += 1
            self.log.published(batch.last_seq)
