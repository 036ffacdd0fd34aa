"""L3 outages: the breaker fails fast and recovers by itself; queued uploads land after a restart."""

from __future__ import annotations

import asyncio
import time

from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.circuit_breaker import BreakerState, CircuitBreaker
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.miss import Miss, MissReason
from kvmesh.tiers.s3_client import fast_fail_client
from kvmesh.tiers.upload_queue import UploadQueue


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_fails_fast_and_half_opens_one_probe() -> None:
    clock = _Clock()
    br = CircuitBreaker(failure_threshold=2, reset_after_s=5.0, clock=clock)
    br.record_failure()
    assert br.allow() and br.state is BreakerState.CLOSED
    br.record_failure()
    assert br.state is BreakerState.OPEN and not br.allow() and br.opens == 1
    clock.t += 5.0
    assert br.allow()  # the probe
    assert not br.allow()  # only one at a time
    br.record_failure()  # probe failed: open again for another reset period
    assert br.state is BreakerState.OPEN and not br.allow()
    clock.t += 5.0
    assert br.allow()
    br.record_success()
    assert br.state is BreakerState.CLOSED and br.allow()


def test_a_probe_that_reports_nothing_lapses_and_the_next_caller_probes() -> None:
    """A probe whose call raised an error the caller does not count would otherwise keep L3 off for good."""
    clock = _Clock()
    br = CircuitBreaker(failure_threshold=1, reset_after_s=5.0, clock=clock)
    br.record_failure()
    clock.t += 5.0
    assert br.allow()  # the probe goes out and never reports back
    clock.t += 4.9
    assert not br.allow()  # still its turn
    clock.t += 0.1
    assert br.allow()  # lapsed: a new probe
    br.record_success()
    assert br.state is BreakerState.CLOSED


async def _until(cond, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


async def test_upload_queue_budget_drops_only_what_it_cannot_hold(s3_server, make_chain, fp) -> None:
    """Without an L2 to read from, the queue owns every byte: the chunks past its budget are dropped and
    counted, never the chain's prefix, and never by blocking the caller."""
    client = fast_fail_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    store = L3Store(client, "kvmesh-queue-full", fp, chunk_blocks=4)
    blocks = make_chain(8)
    chain = [encode_kv_block(b, fp) for b in blocks]
    hashes = [b.block_hash for b in blocks]
    queue = UploadQueue(store, max_bytes=sum(len(b) for b in chain[:4]) + 1024)
    assert not queue.submit("ns", hashes, chain)  # the first chunk fits, the second does not
    assert (queue.stats.chunks_dropped, queue.pending_chunks) == (1, 1)
    assert 0 < queue.queued_bytes <= queue.max_bytes
    assert not queue.submit("ns", hashes, chain)  # the first is already queued: coalesced, not held twice
    assert (queue.stats.chunks_coalesced, queue.stats.chunks_dropped, queue.pending_chunks) == (1, 2, 1)


async def test_upload_queue_skips_a_bad_chunk_and_keeps_going(s3_server, make_chain, fp) -> None:
    client = fast_fail_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    store = L3Store(client, "kvmesh-queue-bad", fp, chunk_blocks=4)
    store.ensure_bucket()
    queue = UploadQueue(store, max_bytes=1 << 30)
    blocks = make_chain(4)
    assert queue.submit("ns", [b"\x01" * 32], [b"not a block"])
    assert queue.submit("ns", [b.block_hash for b in blocks], [encode_kv_block(b, fp) for b in blocks])
    queue.start()
    try:
        assert await queue.join(timeout_s=30)
    finally:
        await queue.close()
    assert (queue.stats.chunks_failed, queue.stats.chunks_written, queue.queued_bytes) == (1, 1, 0)


async def test_s3_stop_mid_upload_opens_breaker_and_uploads_resume(fresh_s3_server, make_chain, fp) -> None:
    server = fresh_s3_server
    client = fast_fail_client(server.endpoint, server.access_key, server.secret_key, connect_timeout_s=0.5)
    breaker = CircuitBreaker(failure_threshold=2, reset_after_s=0.3)
    store = L3Store(client, "kvmesh-outage", fp, chunk_blocks=4, breaker=breaker)
    store.ensure_bucket()
    chains = [make_chain(4, seed=s) for s in range(24)]
    landed: list[bytes] = []
    queue = UploadQueue(store, max_bytes=1 << 30, backoff_initial_s=0.05, backoff_max_s=0.3,
                        on_uploaded=landed.extend)

    def submit(chain) -> bool:
        return queue.submit("ns", [b.block_hash for b in chain], [encode_kv_block(b, fp) for b in chain])

    for chain in chains[:16]:
        submit(chain)
    queue.start()
    try:
        assert await _until(lambda: queue.stats.chunks_written >= 2, 30)
        await asyncio.to_thread(server.stop)  # mid-upload: the queue may still hold chains
        for chain in chains[16:]:  # submitting during the outage neither blocks nor crashes
            assert submit(chain)
        assert await _until(lambda: breaker.opens >= 1, 30)
        assert queue.queued_bytes > 0  # nothing is lost while S3 is down: the chains wait
        t0 = time.monotonic()
        miss = store.get_chunk(store.key("ns", landed[3]))
        assert isinstance(miss, Miss) and miss.reason in (MissReason.TIER_DOWN, MissReason.UNAVAILABLE)
        assert time.monotonic() - t0 < 1.0  # fails fast: the caller recomputes
        await asyncio.to_thread(server.start)  # same port, same data dir
        assert await queue.join(timeout_s=60)
        assert breaker.state is BreakerState.CLOSED
    finally:
        await queue.close()
    assert queue.stats.chunks_written == 24 and queue.stats.retries > 0 and queue.stats.chunks_lost == 0
    objects = list(client.list_objects(store.bucket, prefix=f"{fp}/ns/", recursive=True))
    assert len(objects) == 24
    for obj in objects:  # nothing partial reads as valid: every object verifies completely
        assert not isinstance(store.get_chunk(obj.object_name), Miss)
    for chain in chains:
        assert len(store.load_prefix("ns", [b.block_hash for b in chain])) == 4
