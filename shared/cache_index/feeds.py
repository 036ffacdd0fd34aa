"""Events and dumps into the index, with per-worker epochs, sequence numbers and gap repair.

Each worker has a `Feed`: its current epoch and the next sequence number
expected. An event below it is a duplicate (skipped); one above it opens a
gap: the feed holds later events and the caller must fetch that worker's
state dump (`apply_dump`), which replaces the worker's entries and resumes
the feed after the dump's sequence number. A newer epoch drops the worker's
entries (it restarted); an older one is stale and ignored. A purged worker
(heartbeat lapsed) ignores its epoch's stragglers until a newer epoch shows up.
A lost event with nothing after it opens no gap by itself; `lagging` finds it
from the worker's heartbeat (how far its events are in the stream): a feed
that stays behind that mark without moving has lost something.
The result after all events and dumps is the union of the workers' true
states, whatever was dropped, duplicated or reordered on the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.cache_index.index import BlockIndex, keys_of
from kvmesh.kv_events.dump import WorkerState
from kvmesh.kv_events.events import (
    BlockMoved,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from kvmesh.protocol.blocks import Tier

MAX_HELD = 10_000  # events held during a gap; beyond, the dump (plus a later one) covers them


@dataclass(slots=True)
class Feed:
    epoch: int
    next_seq: int = 1
    gap: bool = False
    dead: bool = False
    held: list[KVEvent] = field(default_factory=list)


@dataclass(slots=True)
class IndexState:
    """The index plus what it needs to stay exact: feeds, and the last stream sequence applied."""

    index: BlockIndex = field(default_factory=BlockIndex)
    feeds: dict[str, Feed] = field(default_factory=dict)
    stream_seq: int = 0  # KV_EVENTS sequence of the last batch applied (a snapshot resumes after it)
    events_applied: int = 0
    behind: dict[str, tuple[float, tuple[int, int] | None]] = field(default_factory=dict)  # worker -> (since, at)

    def gaps(self) -> list[str]:
        """Workers waiting for a state dump."""
        return [w for w, f in self.feeds.items() if f.gap and not f.dead]

    def apply_batch(self, batch: KVEventBatch, stream_seq: int = 0) -> bool:
        """Apply what follows on from the worker's feed; True if the worker now needs a dump."""
        if stream_seq:
            self.stream_seq = max(self.stream_seq, stream_seq)
        feed = self._feed_for(batch.worker, batch.epoch)
        if feed is None:
            return False
        for ev in batch.events:
            if ev.seq < feed.next_seq:
                continue
            if feed.gap or ev.seq > feed.next_seq:
                feed.gap = True
                if len(feed.held) < MAX_HELD:
                    feed.held.append(ev)
                continue
            self._apply(batch.worker, ev)
            feed.next_seq += 1
        return feed.gap

    def apply_dump(self, state: WorkerState) -> bool:
        """Replace the worker's L1/L2 with `state`, then replay held events after it; True if a gap remains."""
        feed = self._feed_for(state.worker, state.epoch, revive=True)
        if feed is None:
            return False
        self.index.clear_worker(state.worker)
        self.index.add(state.worker, Tier.L1, keys_of(state.l1))
        self.index.add(state.worker, Tier.L2, keys_of(state.l2))
        held = sorted(feed.held, key=lambda e: e.seq)
        feed.next_seq, feed.gap, feed.dead, feed.held = state.seq + 1, False, False, []
        for ev in held:
            if ev.seq < feed.next_seq:
                continue
            if feed.gap or ev.seq > feed.next_seq:
                feed.gap = True
                feed.held.append(ev)
                continue
            self._apply(state.worker, ev)
            feed.next_seq += 1
        return feed.gap

    def lagging(self, worker: str, epoch: int, published_seq: int, now: float, grace_s: float) -> bool:
        """The worker says events up to `published_seq` of `epoch` are in the stream. True when the feed
        has stayed behind that, without moving, for `grace_s`: the feed is then marked as a gap (dump it)."""
        feed = self.feeds.get(worker)
        if feed is not None and (feed.dead or feed.gap or epoch < feed.epoch):
            self.behind.pop(worker, None)  # purged, already repairing, or a stale heartbeat
            return False
        at = None if feed is None else (feed.epoch, feed.next_seq)
        if published_seq < 1 or (feed is not None and epoch == feed.epoch and published_seq < feed.next_seq):
            self.behind.pop(worker, None)  # caught up
            return False
        since, was_at = self.behind.setdefault(worker, (now, at))
        if was_at != at:  # the feed moved since: still applying, the clock starts again
            self.behind[worker] = (now, at)
            return False
        if now - since < grace_s:
            return False
        del self.behind[worker]
        feed = self._feed_for(worker, epoch)  # a lost WorkerCleared: the index never saw this epoch
        if feed is None:
            return False
        feed.gap = True
        return True

    def purge(self, worker: str) -> None:
        """The worker is gone (heartbeat lapsed): drop its L1/L2 and ignore its epoch's stragglers."""
        self.index.clear_worker(worker, release=True)
        self.behind.pop(worker, None)
        feed = self.feeds.get(worker)
        if feed is not None:
            feed.dead, feed.gap, feed.held = True, False, []

    def revive(self, worker: str) -> bool:
        """The worker's heartbeat is back after a purge: True if its state must be fetched by a dump."""
        feed = self.feeds.get(worker)
        if feed is None or not feed.dead:
            return False
        feed.dead, feed.gap = False, True
        return True

    # --- internals -----------------------------------------------------

    def _feed_for(self, worker: str, epoch: int, revive: bool = False) -> Feed | None:
        feed = self.feeds.get(worker)
        if feed is None or epoch > feed.epoch:
            if feed is not None:
                self.index.clear_worker(worker)  # a new incarnation: the old one's blocks are gone
            feed = self.feeds[worker] = Feed(epoch)
        elif epoch < feed.epoch or (feed.dead and not revive):
            return None
        return feed

    def _apply(self, worker: str, ev: KVEvent) -> None:
        self.events_applied += 1
        index = self.index
        if isinstance(ev, BlockStored):
            index.add(worker, ev.tier, keys_of(ev.hashes))
        elif isinstance(ev, BlockRemoved):
            index.discard(worker, ev.tier, keys_of(ev.hashes))
        elif isinstance(ev, BlockMoved):
            keys = keys_of(ev.hashes)
            index.discard(worker, ev.src, keys)
            index.add(worker, ev.dst, keys)
        else:  # WorkerCleared
            index.clear_worker(worker)
