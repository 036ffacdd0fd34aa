"""A worker's KV event log: numbered, coalesced, batched; thread-safe; no I/O.

The engine's `KVEventListener` (L1 changes, on the engine thread) plus
`stored` / `removed` / `moved` / `cleared` for the other tiers (any thread).
Each change takes the next sequence number of this epoch under a lock;
consecutive changes of one kind and tier join one event (a chain stored block
by block becomes one `BlockStored`). `take_batch` hands out the oldest
pending events as one `KVEventBatch` (sealed: nothing joins them any more);
`published` drops them once the stream has them. A backlog beyond
`max_pending_hashes` loses its oldest events, which the index sees as a gap.
The log also mirrors the L1/L2 state its events describe, for state dumps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvmesh.kv_events.dump import WorkerState
from kvmesh.kv_events.events import (
    BlockMoved,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    WorkerCleared,
)
from kvmesh.protocol import subjects
from kvmesh.protocol.block_hash import BlockHash
from kvmesh.protocol.blocks import Tier

Source = Callable[[], tuple[list[bytes], list[bytes]]]  # the worker's (L1 hashes, L2 hashes) now


@dataclass(slots=True)
class _Pending:
    """An event under construction (mutable, so consecutive changes can join it)."""

    kind: str
    seq: int
    hashes: list[str]
    tier: Tier | None = None
    src: Tier | None = None
    parent: str | None = None
    tokens_per_block: int = 0
    sealed: bool = False  # taken into a batch, or covered by a state dump: nothing joins it any more
    session_id: str | None = None  # stored runs only: the session whose job stored them

    def build(self, epoch: int) -> KVEvent:
        if self.kind == "stored" and self.tier is not None:
            return BlockStored(seq=self.seq, hashes=self.hashes, parent=self.parent,
                               tokens_per_block=self.tokens_per_block, tier=self.tier, session_id=self.session_id)
        if self.kind == "removed" and self.tier is not None:
            return BlockRemoved(seq=self.seq, hashes=self.hashes, tier=self.tier)
        if self.kind == "moved" and self.tier is not None and self.src is not None:
            return BlockMoved(seq=self.seq, hashes=self.hashes, src=self.src, dst=self.tier)
        return WorkerCleared(seq=self.seq, epoch=epoch)


@dataclass(slots=True)
class EventLog:
    worker_id: str
    max_batch_hashes: int = 8192
    max_pending_hashes: int = 1_000_000
    epoch: int = field(default_factory=time.time_ns)
    on_pending: Callable[[], None] = lambda: None  # called (outside the lock) when the log stops being empty
    dropped_hashes: int = 0
    published_seq: int = 0  # every event up to this one is in the stream (or was shed from the backlog)
    _seq: int = 0
    _pending: list[_Pending] = field(default_factory=list)
    _pending_hashes: int = 0
    _held: dict[Tier, set[str]] = field(default_factory=lambda: {Tier.L1: set(), Tier.L2: set()})
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        subjects.token(self.worker_id)

    @property
    def seq(self) -> int:
        return self._seq

    def __len__(self) -> int:
        """Pending (unpublished) events."""
        return len(self._pending)

    # --- the engine's KVEventListener (L1) -----------------------------

    def block_stored(self, block_hash: BlockHash, parent_hash: BlockHash | None, num_tokens: int) -> None:
        self.stored([block_hash], Tier.L1, parent=parent_hash, tokens_per_block=num_tokens)

    def block_removed(self, block_hash: BlockHash) -> None:
        self.removed([block_hash], Tier.L1)

    # --- tier changes --------------------------------------------------

    def stored(self, hashes: Iterable[bytes], tier: Tier, parent: bytes | None = None,
               tokens_per_block: int = 1, session_id: str | None = None) -> None:
        """`hashes` (a chain run, in order, after `parent`) are now in `tier`, stored for `session_id` if known."""
        hx = [h.hex() for h in hashes]
        if hx:
            self._record("stored", hx, tier, parent=parent.hex() if parent else None, tpb=tokens_per_block,
                         session_id=session_id)

    def removed(self, hashes: Iterable[bytes], tier: Tier) -> None:
        hx = [h.hex() for h in hashes]
        if hx:
            self._record("removed", hx, tier)

    def moved(self, hashes: Iterable[bytes], src: Tier, dst: Tier) -> None:
        hx = [h.hex() for h in hashes]
        if hx:
            self._record("moved", hx, dst, src=src)

    def cleared(self) -> None:
        """The worker dropped all its L1/L2 blocks (also the first event of every epoch)."""
        self._record("cleared", [], None)

    # --- batches and dumps ---------------------------------------------

    def take_batch(self) -> KVEventBatch | None:
        """The oldest pending events (up to max_batch_hashes) as one batch; None when nothing is pending."""
        with self._lock:
            if not self._pending:
                return None
            take, n = 0, 0
            while take < len(self._pending) and (
                    take == 0 or n + len(self._pending[take].hashes) <= self.max_batch_hashes):
                self._pending[take].sealed = True
                n += len(self._pending[take].hashes)
                take += 1
            events = [p.build(self.epoch) for p in self._pending[:take]]
        return KVEventBatch(worker=self.worker_id, epoch=self.epoch, events=events)

    def published(self, last_seq: int) -> None:
        """Events up to `last_seq` are in the stream (by seq: the backlog may have been shed meanwhile)."""
        with self._lock:
            self.published_seq = max(self.published_seq, last_seq)
            while self._pending and self._pending[0].seq <= last_seq:
                self._pending_hashes -= len(self._pending.pop(0).hashes)

    def state_dump(self, source: Source | None = None) -> WorkerState:
        """L1/L2 as of the current seq. The seq is read first: every event up to it is already in
        the state read after it; later events may be too, and replaying them is idempotent."""
        with self._lock:
            seq = self._seq
            if self._pending:  # a change after the dump must get a seq above it, not join event `seq`
                self._pending[-1].sealed = True
            if source is None:
                return WorkerState(self.worker_id, self.epoch, seq, sorted(self._held[Tier.L1]),
                                   sorted(self._held[Tier.L2]))
        l1, l2 = source()
        return WorkerState(self.worker_id, self.epoch, seq, [h.hex() for h in l1], [h.hex() for h in l2])

    # --- internals -----------------------------------------------------

    def _record(self, kind: str, hx: list[str], tier: Tier | None, src: Tier | None = None,
                parent: str | None = None, tpb: int = 0, session_id: str | None = None) -> None:
        cap = self.max_batch_hashes
        with self._lock:
            was_empty = not self._pending
            self._mirror(kind, hx, tier, src)
            for i in range(0, max(1, len(hx)), cap):  # a huge run becomes several events
                self._append(kind, hx[i : i + cap], tier, src, parent if i == 0 else hx[i - 1], tpb, session_id)
            self._shed()
        if was_empty:
            self.on_pending()

    def _append(self, kind: str, hx: list[str], tier: Tier | None, src: Tier | None,
                parent: str | None, tpb: int, session_id: str | None = None) -> None:
        last = self._pending[-1] if self._pending else None
        if (last is not None and not last.sealed and last.kind == kind and last.tier == tier
                and last.src == src and len(last.hashes) + len(hx) <= self.max_batch_hashes
                and (kind in ("removed", "moved")
                     or (kind == "stored" and last.tokens_per_block == tpb and parent == last.hashes[-1]
                         and last.session_id == session_id))):
            last.hashes.extend(hx)
        else:
            self._seq += 1
            self._pending.append(_Pending(kind, self._seq, list(hx), tier, src, parent, tpb,
                                          session_id=session_id))
        self._pending_hashes += len(hx)

    def _mirror(self, kind: str, hx: list[str], tier: Tier | None, src: Tier | None) -> None:
        if kind == "cleared":
            for held in self._held.values():
                held.clear()
            return
        if kind == "moved" and src in self._held:
            self._held[src].difference_update(hx)
        if tier in self._held:
            if kind == "removed":
                self._held[tier].difference_update(hx)
            else:
                self._held[tier].update(hx)

    def _shed(self) -> None:
        # NATS unreachable for long: drop the oldest events; the index repairs the gap by a dump.
        while self._pending_hashes > self.max_pending_hashes and len(self._pending) > 1:
            gone = self._pending.pop(0)
            self._pending_hashes -= len(gone.hashes)
            self.dropped_hashes += len(gone.hashes)
