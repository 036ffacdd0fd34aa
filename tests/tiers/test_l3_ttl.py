"""A named cache's TTL wins over the default upload TTL in L3, whatever the order of the writes (real S3).

The store's default TTL (tiers.l3_ttl_s, here one hour) differs from the
named cache's (two days). The normal upload queue and the named cache's own
write reach the same chunks first, second, or racing; every object's TTL
metadata ends as the named one, and a later default write never shortens it.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import replace

import pytest
from kvmesh.eviction.l3_gc import scan
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.known_chunks import KnownChunks
from kvmesh.tiers.l3_store import L3Store, WriteOutcome
from kvmesh.tiers.s3_client import fast_fail_client
from kvmesh.tiers.upload_queue import UploadQueue

DEFAULT_TTL = 3600
NAMED_TTL = 2 * 24 * 3600
NS = "t-named"


def _store(s3_server, fp: str) -> L3Store:
    client = fast_fail_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    store = L3Store(client, f"t-{uuid.uuid4().hex[:12]}", fp, chunk_blocks=2, ttl_s=DEFAULT_TTL,
                    known=KnownChunks(1024, 600))
    store.ensure_bucket()
    return store


def _ttls(store: L3Store) -> dict[str, float]:
    return {o.key: o.ttl_s for o in scan(store)}


def _assert_named(store: L3Store, n_chunks: int, since: float) -> None:
    objects = scan(store)
    assert len(objects) == n_chunks
    for o in objects:
        assert o.ttl_s == NAMED_TTL, (o.key, o.ttl_s)
        assert o.expires_at >= since + NAMED_TTL - 1


async def test_named_write_after_the_upload_extends_its_objects(s3_server, make_chain, fp) -> None:
    store = _store(s3_server, fp)
    chain = [encode_kv_block(b, fp) for b in make_chain(5)]
    hashes = [b.block_hash for b in make_chain(5)]
    queue = UploadQueue(store, 1 << 24, tail_delay_s=0.0)
    queue.start()
    try:
        assert queue.submit(NS, hashes, chain)
        assert await queue.join(30)
    finally:
        await queue.close()
    assert set(_ttls(store).values()) == {DEFAULT_TTL}  # the upload's TTL, all three chunks known now
    t0 = time.time()
    named = replace(store, ttl_s=NAMED_TTL)
    named.put_chain(NS, chain)
    assert store.stats.chunks_extended == 3  # the known set did not let the longer TTL skip them
    _assert_named(store, 3, t0)
    # A later default write (upload of the same chain) changes nothing.
    out = store.write_chunk(NS, chain[:2], hashes[:2])
    assert out.outcome in (WriteOutcome.KNOWN, WriteOutcome.EXISTING)
    _assert_named(store, 3, t0)


def test_named_write_first_is_never_shortened(s3_server, make_chain, fp) -> None:
    store = _store(s3_server, fp)
    blocks = make_chain(4, seed=3)
    chain, hashes = [encode_kv_block(b, fp) for b in blocks], [b.block_hash for b in blocks]
    t0 = time.time()
    replace(store, ttl_s=NAMED_TTL).put_chain(NS, chain)
    fresh = _store(s3_server, fp)  # another worker: knows nothing, stats every chunk
    fresh = replace(fresh, bucket=store.bucket)
    assert [fresh.write_chunk(NS, chain[i:i + 2], hashes[i:i + 2]).outcome for i in (0, 2)] == \
        [WriteOutcome.EXISTING] * 2
    _assert_named(store, 2, t0)


@pytest.mark.parametrize("seed", range(4))
def test_racing_upload_and_named_write_end_with_the_named_ttl(s3_server, make_chain, fp, seed) -> None:
    store = _store(s3_server, fp)
    blocks = make_chain(6, seed=10 + seed)
    chain, hashes = [encode_kv_block(b, fp) for b in blocks], [b.block_hash for b in blocks]
    named = replace(store, ttl_s=NAMED_TTL)  # shares the store's known set and key locks, as in a worker
    barrier = threading.Barrier(3)
    errors: list[BaseException] = []

    def upload() -> None:
        barrier.wait()
        for i in range(0, 6, 2):
            store.write_chunk(NS, chain[i:i + 2], hashes[i:i + 2])

    def named_write() -> None:
        barrier.wait()
        named.put_chain(NS, chain)

    def run(fn) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    t0 = time.time()
    threads = [threading.Thread(target=run, args=(fn,)) for fn in (upload, upload, named_write)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    _assert_named(store, 3, t0)


def test_upload_queue_then_named_write_in_one_event_loop(s3_server, make_chain, fp) -> None:
    """The worker's order: the chain is queued for upload, then the named cache writes it and waits."""
    store = _store(s3_server, fp)
    blocks = make_chain(6, seed=40)
    chain, hashes = [encode_kv_block(b, fp) for b in blocks], [b.block_hash for b in blocks]

    async def main() -> None:
        queue = UploadQueue(store, 1 << 24, tail_delay_s=0.0)
        queue.start()
        try:
            assert queue.submit(NS, hashes, chain)
            await asyncio.to_thread(replace(store, ttl_s=NAMED_TTL).put_chain, NS, chain)
            assert await queue.join(30)
        finally:
            await queue.close()

    t0 = time.time()
    asyncio.run(main())
    _assert_named(store, 3, t0)
