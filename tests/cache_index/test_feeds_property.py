"""Property: whatever the network does to event batches (drop, duplicate, reorder), once gaps are
repaired by state dumps the index holds exactly the union of the workers' true L1/L2 states, and
two replicas that repaired at different times give the same answers.

Workers are simulated in-process with the real `EventLog`; no NATS, no torch.
"""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvmesh.cache_index.feeds import IndexState
from kvmesh.cache_index.index import key_of
from kvmesh.kv_events.event_log import EventLog
from kvmesh.kv_events.events import BlockStored, KVEventBatch
from kvmesh.protocol.base import ProtocolError
from kvmesh.protocol.blocks import Tier

WORKERS = ("w0", "w1", "w2")
GRACE_S = 3.0


def h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "little")).digest()


class SimWorker:
    """A worker's true L1/L2 (a set per tier) and the log its changes go through."""

    def __init__(self, name: str, epoch: int, batch: int) -> None:
        self.name = name
        self.log = EventLog(name, max_batch_hashes=batch, epoch=epoch)
        self.log.cleared()
        self.truth: dict[Tier, set[bytes]] = {Tier.L1: set(), Tier.L2: set()}

    def step(self, rng: random.Random) -> None:
        op = rng.randrange(6)
        pool = [h(i) for i in range(40)]
        if op <= 1:  # store a chain run in L1 (the engine) or L2
            tier = Tier.L1 if op == 0 else Tier.L2
            start = rng.randrange(30)
            run = pool[start : start + rng.randint(1, 8)]
            self.log.stored(run, tier, parent=pool[start - 1] if start else None, tokens_per_block=16)
            self.truth[tier].update(run)
        elif op == 2 and self.truth[Tier.L1]:  # L1 eviction
            gone = rng.sample(sorted(self.truth[Tier.L1]), k=min(3, len(self.truth[Tier.L1])))
            for g in gone:
                self.log.block_removed(g)
            self.truth[Tier.L1].difference_update(gone)
        elif op == 3 and self.truth[Tier.L1]:  # demote L1 -> L2
            moved = sorted(self.truth[Tier.L1])[: rng.randint(1, 4)]
            self.log.moved(moved, Tier.L1, Tier.L2)
            self.truth[Tier.L1].difference_update(moved)
            self.truth[Tier.L2].update(moved)
        elif op == 4 and self.truth[Tier.L2]:  # L2 eviction
            gone = sorted(self.truth[Tier.L2])[: rng.randint(1, 4)]
            self.log.removed(gone, Tier.L2)
            self.truth[Tier.L2].difference_update(gone)
        elif op == 5 and rng.random() < 0.1:
            self.log.cleared()
            for s in self.truth.values():
                s.clear()

    def restart(self) -> None:
        """A new process under the same id: new epoch, nothing cached."""
        self.log = EventLog(self.name, max_batch_hashes=self.log.max_batch_hashes, epoch=self.log.epoch + 1)
        self.log.cleared()
        for s in self.truth.values():
            s.clear()


def expected(workers: list[SimWorker]) -> dict[int, set[tuple[str, Tier]]]:
    out: dict[int, set[tuple[str, Tier]]] = {}
    for w in workers:
        for tier, hashes in w.truth.items():
            for x in hashes:
                out.setdefault(key_of(x.hex()), set()).add((w.name, tier))
    return out


def actual(state: IndexState) -> dict[int, set[tuple[str, Tier]]]:
    return {k: state.index.holders(k) for k in state.index.masks}


def repair(state: IndexState, by_name: dict[str, SimWorker]) -> None:
    for _ in range(5):  # a dump replays held events; a second gap needs a second dump
        gaps = state.gaps()
        if not gaps:
            return
        for w in gaps:
            state.apply_dump(by_name[w].log.state_dump())
    raise AssertionError(f"gaps not repaired: {state.gaps()}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 120), drop=st.floats(0, 0.3),
       dup=st.floats(0, 0.3), shuffle=st.floats(0, 0.3), batch=st.integers(1, 12),
       restarts=st.booleans())
def test_index_equals_union_of_true_states_after_repair(seed, steps, drop, dup, shuffle, batch, restarts):
    rng = random.Random(seed)
    workers = [SimWorker(name, epoch=1000 + i, batch=batch) for i, name in enumerate(WORKERS)]
    by_name = {w.name: w for w in workers}
    state = IndexState()
    lazy = IndexState()  # a second replica: same stream order, its dumps fetched only at the end
    wire: list[KVEventBatch] = []

    def deliver(b: KVEventBatch) -> None:
        state.apply_batch(b)
        lazy.apply_batch(b)

    for _ in range(steps):
        w = rng.choice(workers)
        if restarts and rng.random() < 0.02:
            w.restart()
        w.step(rng)
        if rng.random() < 0.5:
            while (b := w.log.take_batch()) is not None:
                w.log.published(b.last_seq)
                if rng.random() >= drop:
                    wire.append(b)
                if rng.random() < dup:
                    wire.append(b)
        if wire and rng.random() < shuffle:  # deliver a window out of order
            i = rng.randrange(len(wire))
            wire[i:] = rng.sample(wire[i:], len(wire) - i)
        while wire and rng.random() < 0.7:
            deliver(wire.pop(0))
            if rng.random() < 0.3:
                repair(state, by_name)
    for b in wire:
        deliver(b)
    for w in workers:  # the tail: a publisher retries until the stream has it, so the last batch arrives
        while (b := w.log.take_batch()) is not None:
            w.log.published(b.last_seq)
            deliver(b)
    # A worker whose last events were all dropped shows no gap until its next event arrives, or until
    # its heartbeat says they are in the stream and the feed stays behind that for the grace period.
    for replica in (state, lazy):
        for now in (0.0, GRACE_S):
            for w in workers:
                replica.lagging(w.name, w.log.epoch, w.log.published_seq, now, GRACE_S)
    repair(state, by_name)
    repair(lazy, by_name)
    assert actual(state) == expected(workers) == actual(lazy)
    probe = [key_of(h(i).hex()) for i in range(40)]
    assert state.index.lookup(probe) == lazy.index.lookup(probe)


def test_duplicates_alone_never_need_a_dump():
    w = SimWorker("w0", epoch=1, batch=4)
    rng = random.Random(7)
    state = IndexState()
    for _ in range(200):
        w.step(rng)
        while (b := w.log.take_batch()) is not None:
            w.log.published(b.last_seq)
            assert not state.apply_batch(b)
            assert not state.apply_batch(b)  # the redelivery changes nothing
    assert state.gaps() == []
    assert actual(state) == expected([w])


def test_worker_cleared_and_new_epoch_drop_entries():
    w = SimWorker("w0", epoch=5, batch=64)
    state = IndexState()
    w.log.stored([h(1), h(2)], Tier.L1, tokens_per_block=16)
    state.apply_batch(w.log.take_batch())
    assert len(state.index) == 2
    w.log.published(w.log.seq)
    w.log.cleared()
    state.apply_batch(w.log.take_batch())
    assert len(state.index) == 0
    w.log.published(w.log.seq)
    w.log.stored([h(3)], Tier.L2, tokens_per_block=16)
    state.apply_batch(w.log.take_batch())
    newer = EventLog("w0", epoch=6)
    newer.cleared()
    newer.published(newer.take_batch().last_seq)  # its WorkerCleared is lost on the way
    newer.stored([h(4)], Tier.L1, tokens_per_block=16)  # WorkerCleared lost: the epoch alone clears
    state.apply_batch(newer.take_batch())
    assert actual(state) == {}  # the old epoch's blocks are gone; seq 2 waits for the gap's repair
    assert state.gaps() == ["w0"]
    assert not state.apply_dump(newer.state_dump())
    assert actual(state) == {key_of(h(4).hex()): {("w0", Tier.L1)}}
    old = EventLog("w0", epoch=5)
    old.stored([h(9)], Tier.L1, tokens_per_block=16)
    state.apply_batch(old.take_batch())  # a straggler of the old epoch is ignored
    assert key_of(h(9).hex()) not in state.index.masks


def test_a_shed_backlog_is_a_gap_the_dump_repairs():
    """A worker that could not publish for long drops its oldest events; the index still ends exact."""
    w = SimWorker("w0", epoch=1, batch=4)
    w.log.max_pending_hashes = 6
    state = IndexState()
    for i in range(10):  # alternating kinds: each change is an event of its own
        if i % 3 == 2:
            w.log.removed([h(i)], Tier.L1)
        else:
            w.log.stored([h(100 + i)], Tier.L2, tokens_per_block=16)
            w.truth[Tier.L2].add(h(100 + i))
    assert w.log.dropped_hashes > 0
    while (b := w.log.take_batch()) is not None:
        w.log.published(b.last_seq)
        state.apply_batch(b)
    assert state.gaps() == ["w0"]
    assert not state.apply_dump(w.log.state_dump())
    assert actual(state) == expected([w])


def test_events_with_malformed_hashes_are_rejected_whole():
    bad = KVEventBatch(worker="w", epoch=1,
                       events=[BlockStored(seq=1, hashes=["ab" * 32], tokens_per_block=16, tier=Tier.L1)])
    data = bad.to_bytes().replace(b"ab" * 32, b"zz" * 32)
    with pytest.raises(ProtocolError):
        KVEventBatch.from_bytes(data)
    assert KVEventBatch.from_bytes(bad.to_bytes()) == bad
    cleared = b'{"schema_version":1,"kind":"cleared","seq":3,"epoch":1},'
    with pytest.raises(ProtocolError):  # seqs 3, 1: not consecutive
        KVEventBatch.from_bytes(bad.to_bytes().replace(b'"events":[', b'"events":[' + cleared))


def test_lagging_waits_for_a_stalled_feed_and_restarts_its_clock_on_progress():
    state = IndexState()
    log = EventLog("w", epoch=7)
    log.cleared()
    log.stored([h(1)], Tier.L1, tokens_per_block=16)
    first = log.take_batch()
    log.published(first.last_seq)
    state.apply_batch(first)  # seq 1 (cleared) and 2 (stored) applied: next expected is 3
    assert not state.lagging("w", 7, 2, now=0.0, grace_s=GRACE_S)  # caught up
    log.stored([h(2)], Tier.L1, tokens_per_block=16)
    lost = log.take_batch()
    log.published(lost.last_seq)  # seq 3 is in the stream, but this replica never gets it
    assert not state.lagging("w", 7, 3, now=10.0, grace_s=GRACE_S)  # the clock starts
    assert not state.lagging("w", 7, 3, now=12.0, grace_s=GRACE_S)
    assert state.lagging("w", 7, 3, now=13.0, grace_s=GRACE_S)  # stuck behind for 3 s: dump it
    assert state.gaps() == ["w"]
    state.apply_dump(log.state_dump())
    assert state.index.holders(key_of(h(2).hex())) == {("w", Tier.L1)}
    assert not state.lagging("w", 7, 3, now=20.0, grace_s=GRACE_S)

    log.stored([h(3)], Tier.L1, tokens_per_block=16)
    slow = log.take_batch()
    log.published(slow.last_seq)
    assert not state.lagging("w", 7, 4, now=30.0, grace_s=GRACE_S)
    state.apply_batch(slow)  # it arrives late, before the grace ran out
    assert not state.lagging("w", 7, 4, now=40.0, grace_s=GRACE_S)
    assert state.gaps() == []


def test_lagging_finds_an_epoch_whose_events_were_all_lost_and_skips_purged_workers():
    state = IndexState()
    old = EventLog("w", epoch=1)
    old.cleared()
    old.stored([h(1)], Tier.L1, tokens_per_block=16)
    state.apply_batch(old.take_batch())
    new = EventLog("w", epoch=2)  # restarted; its WorkerCleared and first block never reached the index
    new.cleared()
    new.stored([h(5)], Tier.L2, tokens_per_block=16)
    b = new.take_batch()
    new.published(b.last_seq)
    assert not state.lagging("w", 2, new.published_seq, now=0.0, grace_s=GRACE_S)
    assert state.lagging("w", 2, new.published_seq, now=GRACE_S, grace_s=GRACE_S)
    assert state.index.holders(key_of(h(1).hex())) == set()  # the old epoch's blocks are gone already
    state.apply_dump(new.state_dump())
    assert state.index.holders(key_of(h(5).hex())) == {("w", Tier.L2)}

    state.purge("w")
    assert not state.lagging("w", 2, 99, now=0.0, grace_s=GRACE_S)
    assert not state.lagging("w", 2, 99, now=100.0, grace_s=GRACE_S)  # dead: only a new heartbeat revives it
