"""The worker-side event log: coalescing, batch limits, sealing, dumps from a source, thread safety."""

from __future__ import annotations

import hashlib
import threading

from kvmesh.cache_index.feeds import IndexState
from kvmesh.cache_index.index import key_of
from kvmesh.kv_events.event_log import EventLog
from kvmesh.kv_events.events import BlockMoved, BlockRemoved, BlockStored, WorkerCleared
from kvmesh.protocol.blocks import Tier


def chain(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(n)]


def test_engine_stores_coalesce_into_one_event_per_chain_run():
    log = EventLog("w", max_batch_hashes=100)
    log.cleared()
    c = chain(10)
    for i, h in enumerate(c):
        log.block_stored(h, c[i - 1] if i else None, 16)
    other = chain(3, "x")
    log.block_stored(other[0], None, 16)  # a new chain: its parent is not the last hash -> a new event
    log.block_removed(c[9])
    log.block_removed(c[8])
    log.moved(c[:2], Tier.L1, Tier.L2)
    batch = log.take_batch()
    kinds = [type(e) for e in batch.events]
    assert kinds == [WorkerCleared, BlockStored, BlockStored, BlockRemoved, BlockMoved]
    assert [e.seq for e in batch.events] == [1, 2, 3, 4, 5]
    assert batch.events[1].hashes == [h.hex() for h in c] and batch.events[1].parent is None
    assert batch.events[3].hashes == [c[9].hex(), c[8].hex()]


def test_batches_respect_the_hash_limit_and_taken_events_are_sealed():
    log = EventLog("w", max_batch_hashes=4)
    log.stored(chain(10), Tier.L2)  # one call of 10 hashes -> events of at most 4
    first = log.take_batch()
    assert sum(len(e.hashes) for e in first.events) <= 4 and first.first_seq == 1
    log.stored(chain(1, "late"), Tier.L2, parent=chain(10)[-1])
    log.published(first.last_seq)
    rest = []
    while (b := log.take_batch()) is not None:
        log.published(b.last_seq)
        rest.extend(b.events)
    hashes = [h for e in first.events + rest for h in e.hashes]
    assert hashes == [h.hex() for h in chain(10) + chain(1, "late")]
    assert [e.seq for e in first.events + rest] == list(range(1, len(first.events) + len(rest) + 1))


def test_dump_reads_the_source_after_taking_the_seq():
    real = {Tier.L1: chain(3, "l1"), Tier.L2: chain(2, "l2")}
    log = EventLog("w", epoch=9)
    log.cleared()
    log.stored(chain(1, "gone"), Tier.L1)  # the source is the truth, not what the log recorded
    state = log.state_dump(lambda: (real[Tier.L1], real[Tier.L2]))
    assert (state.epoch, state.seq) == (9, 2)
    assert state.l1 == [h.hex() for h in real[Tier.L1]] and state.l2 == [h.hex() for h in real[Tier.L2]]
    log.stored(chain(1, "after"), Tier.L1, parent=chain(1, "gone")[0])  # would have joined seq 2
    assert log.seq == 3  # the dump sealed event 2: a change after it gets a seq above the dump's


def test_concurrent_recording_from_two_threads_keeps_seqs_contiguous():
    log = EventLog("w", max_batch_hashes=64)
    log.cleared()
    index = IndexState()

    blocks = chain(2000, "e")

    def engine_thread() -> None:
        for i, h in enumerate(blocks):
            log.block_stored(h, None if i % 7 == 0 else blocks[i - 1], 16)

    def tier_thread() -> None:
        for h in chain(2000, "t"):
            log.stored([h], Tier.L2)

    threads = [threading.Thread(target=engine_thread), threading.Thread(target=tier_thread)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) or len(log):
        b = log.take_batch()
        if b is not None:
            log.published(b.last_seq)
            assert not index.apply_batch(b)  # never a gap: seqs are handed out under the lock
    for t in threads:
        t.join()
    assert index.index.worker_blocks("w", Tier.L1) == 2000 and index.index.worker_blocks("w", Tier.L2) == 2000
    assert key_of(chain(1, "t")[0].hex()) in index.index.masks
