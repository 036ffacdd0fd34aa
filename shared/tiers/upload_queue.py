"""Asynchronous L3 writes, chunk by chunk, in bounded memory, never blocking the producer.

The producer is a worker's step loop: `submit` never waits. It cuts a chain
into its chunks at once. A chunk the store knows is stored costs nothing more
(`chunks_known`: no encode, no request), so turn N+1 of a session queues only
its new chunks. Any other chunk is queued as a reference: its block hashes,
plus the bytes of only those blocks the `source` (this worker's L2) does not
hold. Only those owned bytes and a small per-chunk overhead count against
`max_bytes`; a chunk that does not fit is dropped and counted, and so is the
rest of its chain. A chain of any length whose blocks L2 holds always fits.

At its turn a chunk is read, encoded and PUT on a thread of the queue's own
at the lowest OS priority (shared/background.py), so an upload waits for
spare CPU rather than delay a token, and the bytes in flight are one chunk.
The blocks it does not own are copied out of the source there, without a
lock: a heap buffer lives while referenced, and a shared-memory block whose
space is freed and reused while it is copied fails the checksum the store
verifies before it writes (a failed chunk, never wrong bytes). The store
also checks every block against the hash it is queued under, so no bytes can
land under another chunk's key.
A chunk whose blocks left L2 before its turn is lost (`chunks_lost`), and so
are the later chunks of its chain: readers walk chunks from position 0 and
never reach past a gap (the next registration of the chain exports the
blocks again and fills it).

Partial tails: a chain's last, partial chunk is keyed by its own last block,
so a growing session would write a new tail object every turn. A tail waits
`tail_delay_s` instead; a later submission that extends the same chain
replaces it (`chunks_coalesced`), so only the tail of a chain left alone for
that long is written. `join` (drain: tests, shutdown) sends every tail at once.

A due chunk waits while the worker is `busy` (serving a request, storing a
chain), for at most `max_defer_s`, so under a steady load the uploads lag
by that much instead of competing with the requests for the cores.

Failed writes are retried with capped exponential backoff until they land, so
an S3 restart loses nothing queued (whose blocks L2 still holds or the queue
owns); while the circuit is open each retry fails fast, and the first retry
after the breaker's reset time is its probe.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.aio import wait_event
from kvmesh.background import background_executor
from kvmesh.retry import Backoff
from kvmesh.tiers.l3_store import ChunkWrite, L3Store, L3Unavailable, WriteOutcome

_QUIET_POLL_S = 0.02  # how often a held chunk looks whether the worker is still busy
_CHUNK_OVERHEAD = 256  # bytes of bookkeeping a queued chunk costs besides its hashes (32 each)


class BlockSource(Protocol):
    """Where queued chunks read the blocks they do not own (a worker's L2); an upload is no access."""

    def __contains__(self, block_hash: bytes) -> bool: ...
    def read(self, block_hash: bytes) -> memoryview | None: ...


@dataclass(slots=True)
class UploadStats:
    """Chunk counts; submitted = known + coalesced + written + existing + lost + dropped + failed + pending."""

    chains_submitted: int = 0
    chunks_submitted: int = 0  # every chunk of every submitted chain
    chunks_known: int = 0  # known stored: no encode, no S3 request (at submit, or by its turn)
    chunks_coalesced: int = 0  # already queued, or a waiting tail replaced by a longer submission
    chunks_written: int = 0  # PUT
    chunks_existing: int = 0  # HEAD found it
    chunks_lost: int = 0  # its blocks left L2 before its turn, or an earlier chunk of its chain did not land
    chunks_dropped: int = 0  # the byte budget could not hold it, or an earlier chunk of its chain
    dropped_bytes: int = 0
    chunks_failed: int = 0  # bytes not those of its hashes (a bug, bad input): never retried
    retries: int = 0
    chunks_deferred: int = 0  # waited for the worker to be idle before going out


class _State(enum.Enum):
    QUEUED = "queued"
    LANDED = "landed"  # written, found, or known
    GAP = "gap"  # did not land: later chunks of the chain are unreachable
    LOST = "lost"  # not queued: its bytes are gone
    DROPPED = "dropped"  # not queued: no room
    REPLACED = "replaced"  # a waiting tail a longer submission covers


@dataclass(slots=True, eq=False)
class _Chunk:
    namespace: str
    hashes: tuple[bytes, ...]
    owned: list  # per block: bytes the queue holds, or None (read from the source at its turn)
    cost: int  # counted against max_bytes until done
    after: _Chunk | None  # the chain's previous chunk, when it was queued too
    due: float  # monotonic time it may go (a tail: after the delay)
    state: _State = _State.QUEUED


@dataclass
class UploadQueue:
    store: L3Store
    max_bytes: int
    source: BlockSource | None = None
    tail_delay_s: float = 5.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 1.0
    stats: UploadStats = field(default_factory=UploadStats)
    queued_bytes: int = field(default=0, init=False)
    on_uploaded: Callable[[list[bytes]], None] | None = None  # hashes of a chunk written or found (not known)
    # True while the worker serves (its engine runs requests, or it stores a chain): a due chunk then
    # waits, up to `max_defer_s` past its due time, so uploads go in the gaps between requests.
    busy: Callable[[], bool] | None = None
    max_defer_s: float = 10.0
    holding: bool = field(default=False, init=False)  # a due chunk is waiting for the worker to be idle
    _ready: deque[_Chunk] = field(default_factory=deque, init=False, repr=False)
    _waiting: dict[tuple[str, bytes], _Chunk] = field(default_factory=dict, init=False, repr=False)  # tails, due order
    _queued: dict[tuple[str, bytes], _Chunk] = field(default_factory=dict, init=False, repr=False)  # not started
    _tails: dict[tuple[str, bytes], list[_Chunk]] = field(default_factory=dict, init=False, repr=False)  # by 1st hash
    _pending: int = field(default=0, init=False, repr=False)
    _draining: int = field(default=0, init=False, repr=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    _idle: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    _task: asyncio.Task | None = field(default=None, init=False, repr=False)
    # Reads, encoding and PUTs run here, at the lowest OS priority: an upload never takes a core from a token.
    _executor: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)

    @property
    def pending_chunks(self) -> int:
        """Chunks queued or in flight."""
        return self._pending

    @property
    def waiting_tails(self) -> int:
        """Partial tail chunks held back for `tail_delay_s` (part of `pending_chunks`)."""
        return len(self._waiting)

    def submit(self, namespace: str, hashes: Sequence[bytes], blocks: Sequence | None = None) -> bool:
        """Queue the chunks of a chain (`hashes`, position 0 first) that are not known stored.

        `blocks[i]`, when given, is the encoded block `hashes[i]` as the caller holds it now; the
        queue keeps it only if the source lacks that block. False when some chunk was dropped or lost.
        """
        ranges = self.store.chunk_ranges(len(hashes))
        self.stats.chains_submitted += 1
        self.stats.chunks_submitted += len(ranges)
        now = time.monotonic()
        after: _Chunk | None = None
        for n, positions in enumerate(ranges):
            first, last = hashes[positions[0]], hashes[positions[-1]]
            if self.store.is_known(namespace, last):
                self.stats.chunks_known += 1
                after = None
            elif (queued := self._queued.get((namespace, last))) is not None:
                self.stats.chunks_coalesced += 1
                after = queued
            else:
                held = self._hold(namespace, hashes, positions, blocks, after, now)
                if not isinstance(held, _Chunk):  # this chunk and the rest of the chain: never reachable now
                    rest = len(ranges) - n
                    if held is _State.LOST:
                        self.stats.chunks_lost += rest
                    else:
                        self.stats.chunks_dropped += rest
                    return False
                after = held
            self._replace_tails(namespace, first, hashes, positions)
        return True

    def start(self) -> None:
        if self._executor is None:
            self._executor = background_executor("l3-upload")
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="l3-upload")

    async def join(self, timeout_s: float) -> bool:
        """Wait until everything submitted has landed (tails are sent at once); False on timeout."""
        if not self._pending:
            return True
        self._draining += 1
        self._wake.set()
        try:
            return await wait_event(self._idle, timeout_s)
        finally:
            self._draining -= 1

    async def close(self) -> None:
        """Stop now; what is still queued is abandoned (`join` first to drain)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._executor is not None:  # a chunk being copied out of L2 finishes before L2 can close
            executor, self._executor = self._executor, None
            await asyncio.to_thread(executor.shutdown, wait=True)

    # -- queueing ----------------------------------------------------------

    def _hold(self, namespace: str, hashes: Sequence[bytes], positions: range, blocks: Sequence | None,
              after: _Chunk | None, now: float) -> _Chunk | _State:
        """Queue one chunk, or say why not: LOST (its bytes are neither in the source nor given) or
        DROPPED (they do not fit in max_bytes)."""
        owned: list = []
        cost = _CHUNK_OVERHEAD + 32 * len(positions)
        for i in positions:
            buf = None
            if self.source is None or hashes[i] not in self.source:
                buf = blocks[i] if blocks is not None else None
                if buf is None:
                    return _State.LOST
                cost += memoryview(buf).nbytes
            owned.append(buf)
        if self.queued_bytes + cost > self.max_bytes:
            self.stats.dropped_bytes += cost
            return _State.DROPPED
        tail = len(positions) < self.store.chunk_blocks
        chunk = _Chunk(namespace, tuple(hashes[i] for i in positions), owned, cost, after,
                       now + (self.tail_delay_s if tail else 0.0))
        key = (namespace, chunk.hashes[-1])
        self._queued[key] = chunk
        if tail:
            self._waiting[key] = chunk
            self._tails.setdefault((namespace, chunk.hashes[0]), []).append(chunk)
        else:
            self._ready.append(chunk)
        self.queued_bytes += cost
        self._pending += 1
        self._idle.clear()
        self._wake.set()
        return chunk

    def _replace_tails(self, namespace: str, first: bytes, hashes: Sequence[bytes], positions: range) -> None:
        """Drop the not yet started tails this chunk extends (hashes are chained: equal last hash = prefix)."""
        tails = self._tails.get((namespace, first))
        if not tails:
            return
        for tail in [t for t in tails if len(t.hashes) < len(positions)
                     and hashes[positions[0] + len(t.hashes) - 1] == t.hashes[-1]]:
            self._unqueue(tail)
            tail.state = _State.REPLACED
            self.stats.chunks_coalesced += 1
            self._done(tail)

    def _unqueue(self, chunk: _Chunk) -> None:
        """No longer waiting nor open to coalescing (started, or replaced)."""
        key = (chunk.namespace, chunk.hashes[-1])
        if self._queued.get(key) is chunk:
            del self._queued[key]
        if self._waiting.get(key) is chunk:
            del self._waiting[key]
        tails = self._tails.get((chunk.namespace, chunk.hashes[0]))
        if tails and chunk in tails:
            tails.remove(chunk)
            if not tails:
                del self._tails[(chunk.namespace, chunk.hashes[0])]

    def _done(self, chunk: _Chunk) -> None:
        chunk.owned, chunk.after = [], None  # frees its bytes, and the chain of done chunks behind it
        self.queued_bytes -= chunk.cost
        self._pending -= 1
        if not self._pending:
            self._idle.set()

    # -- uploading ---------------------------------------------------------

    def _next(self) -> _Chunk | None:
        """The next chunk to send: full chunks in order, then tails that are due (all when draining)."""
        now = time.monotonic()
        # Every tail waits the same delay, so `_waiting` (insertion order) is in due order.
        while self._waiting:
            tail = next(iter(self._waiting.values()))
            if tail.due > now and not self._draining:
                break
            del self._waiting[(tail.namespace, tail.hashes[-1])]
            self._ready.append(tail)
        while self._ready:
            chunk = self._ready.popleft()
            if chunk.state is _State.QUEUED:
                self._unqueue(chunk)
                return chunk
        return None

    async def _run(self) -> None:
        while True:
            chunk = self._next()
            if chunk is not None:
                await self._wait_for_quiet(chunk)
                await self._upload(chunk)
                self._done(chunk)
                continue
            self._wake.clear()
            first_due = next(iter(self._waiting.values())).due if self._waiting else None
            await wait_event(self._wake, None if first_due is None else max(0.0, first_due - time.monotonic()))

    async def _wait_for_quiet(self, chunk: _Chunk) -> None:
        """Hold a chunk while the worker is busy, until `max_defer_s` past its due time (never when draining)."""
        until = chunk.due + self.max_defer_s
        while self.busy is not None and not self._draining and self.busy() and time.monotonic() < until:
            if not self.holding:
                self.holding = True
                self.stats.chunks_deferred += 1
            await asyncio.sleep(_QUIET_POLL_S)
        self.holding = False

    def _write(self, chunk: _Chunk) -> ChunkWrite | None:
        """On the upload thread: read the blocks the chunk does not own from the source, then write it;
        None when one is gone. A block freed and its space reused while it was copied fails the store's
        checksum check (a failed chunk), so these reads need no lock on the source."""
        blocks = [own if own is not None else self.source.read(h) if self.source is not None else None
                  for h, own in zip(chunk.hashes, chunk.owned)]
        if any(b is None for b in blocks):
            return None
        return self.store.write_chunk(chunk.namespace, blocks, chunk.hashes)

    async def _upload(self, chunk: _Chunk) -> None:
        """Land one chunk, retrying while S3 is unavailable; set its state."""
        chunk.state = _State.GAP
        if chunk.after is not None and chunk.after.state is _State.GAP:
            self.stats.chunks_lost += 1
            return
        if self.store.is_known(chunk.namespace, chunk.hashes[-1]):
            chunk.state = _State.LANDED
            self.stats.chunks_known += 1
            return
        backoff = Backoff(self.backoff_initial_s, self.backoff_max_s)
        while True:
            try:
                result = await asyncio.get_running_loop().run_in_executor(self._executor, self._write, chunk)
                if result is None:
                    self.stats.chunks_lost += 1
                    return
                break
            except L3Unavailable:
                self.stats.retries += 1
                await asyncio.sleep(backoff.next())
            except Exception:  # noqa: BLE001 - one bad chunk must not stop the uploader
                self.stats.chunks_failed += 1
                return
        chunk.state = _State.LANDED
        if result.outcome is WriteOutcome.KNOWN:
            self.stats.chunks_known += 1
            return
        if result.outcome is WriteOutcome.WRITTEN:
            self.stats.chunks_written += 1
        else:
            self.stats.chunks_existing += 1
        if self.on_uploaded is not None:
            self.on_uploaded(list(chunk.hashes))
