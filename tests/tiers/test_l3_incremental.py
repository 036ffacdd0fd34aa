"""Incremental L3 writes against a real S3 server: a session's next turn costs only its new chunks.

The S3 client is the real minio client behind a proxy that counts the write path's calls (HEAD = stat,
PUT) and the keys they name, so "no request" is asserted on what reached the server.
"""

from __future__ import annotations

import asyncio
import io
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import replace

from kvmesh.background import LOWEST_PRIORITY, HostIdle, thread_nice
from kvmesh.cache_policy.registry import get_policy
from kvmesh.serving.worker_tiers import L2Source, WorkerTiers, namespace_for
from kvmesh.tiers.arena import HeapArena
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.known_chunks import KnownChunks
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.l3_store import L3Stats, L3Store
from kvmesh.tiers.miss import Miss, MissCounters, MissReason
from kvmesh.tiers.resolver import Resolver
from kvmesh.tiers.s3_client import fast_fail_client
from kvmesh.tiers.shm_slab import SlabArena
from kvmesh.tiers.upload_queue import UploadQueue
from kvmesh.transfer.peer_shm import ShmPeerClient
from waits import until

SALT = "5a" * 32
NS = namespace_for(SALT)
K = 4  # blocks per chunk


class CountingClient:
    """The real minio client; counts the calls the write path makes, with their keys."""

    def __init__(self, client) -> None:
        self._client = client
        self.calls: Counter = Counter()
        self.keys: dict[str, list[str]] = {"head": [], "put": []}

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def stat_object(self, bucket: str, key: str, *args, **kwargs):
        self.calls["head"] += 1
        self.keys["head"].append(key)
        return self._client.stat_object(bucket, key, *args, **kwargs)

    def put_object(self, bucket: str, key: str, *args, **kwargs):
        self.calls["put"] += 1
        self.keys["put"].append(key)
        return self._client.put_object(bucket, key, *args, **kwargs)


def _store(s3_server, fp: str, bucket: str | None = None) -> L3Store:
    raw = fast_fail_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    store = L3Store(CountingClient(raw), bucket or f"inc-{uuid.uuid4().hex[:12]}", fp, chunk_blocks=K,
                    known=KnownChunks(capacity=1024, max_age_s=600.0))
    store.ensure_bucket()
    store.client.calls.clear()  # a bucket created here is probed with one PUT; count the write path only
    store.client.keys = {"head": [], "put": []}
    return store


def _fresh_worker_store(store: L3Store) -> L3Store:
    """Another worker's store of the same bucket: knows nothing yet; same counted client."""
    return replace(store, known=KnownChunks(capacity=1024, max_age_s=600.0), stats=L3Stats())


def _worker(store: L3Store, fp: str, tail_delay_s: float = 3600.0, max_bytes: int = 1 << 30,
            l2_bytes: int = 1 << 30, shm: bool = False) -> WorkerTiers:
    """A worker's tiers as WorkerTiers.start wires them, minus the NATS peer server (unused here)."""
    wid = f"w-{uuid.uuid4().hex[:8]}"
    counters = MissCounters()
    l2 = HostTier(l2_bytes, get_policy("lru"), fp, wid, SlabArena(wid, l2_bytes) if shm else HeapArena(), counters)
    queue = UploadQueue(store, max_bytes, source=L2Source(l2), tail_delay_s=tail_delay_s)
    queue.start()
    resolver = Resolver(wid, l2=l2, l3=store, counters=counters)
    return WorkerTiers(wid, l2, store, queue, ShmPeerClient(fp, counters), resolver, counters)


def _register(tiers: WorkerTiers, blocks) -> None:
    """What a worker does after a turn: export what L2 lacks, register the chain."""
    hashes = [b.block_hash for b in blocks]
    missing = set(tiers.missing(hashes))
    tiers.register(hashes, [b for b in blocks if b.block_hash in missing], SALT)


def _key(store: L3Store, blocks, end: int) -> str:
    return store.key(NS, blocks[end - 1].block_hash)


async def test_next_turn_puts_only_new_chunks_and_asks_nothing_about_known_ones(s3_server, make_chain, fp) -> None:
    store = _store(s3_server, fp)
    calls = store.client.calls
    session = make_chain(4 * K, seed=1)
    tiers = _worker(store, fp)
    try:
        _register(tiers, session[:2 * K])
        assert await tiers.uploads.join(timeout_s=30)
        assert calls == Counter(head=2, put=2)
        _register(tiers, session[:3 * K])  # turn 2: one new chunk
        assert await tiers.uploads.join(timeout_s=30)
        assert calls == Counter(head=3, put=3)
        assert store.client.keys["head"][2:] == store.client.keys["put"][2:] == [_key(store, session, 3 * K)]
        _register(tiers, session[:3 * K])  # the same chain again: nothing to queue, nothing to encode
        assert tiers.uploads.pending_chunks == 0 and calls == Counter(head=3, put=3)
        assert tiers.uploads.stats.chunks_known == 5 and store.stats.bytes_put > 0
    finally:
        await tiers.close()

    # Another worker learns presence from the cache index, a third from its own reads: neither asks S3.
    index_fed = _worker(_fresh_worker_store(store), fp)
    reader = _worker(_fresh_worker_store(store), fp)
    try:
        index_fed.note_l3_present(SALT, [b.block_hash for b in session[:3 * K]], 3 * K + 1)  # clamped: 3 chunks
        _register(index_fed, session[:3 * K])
        assert index_fed.uploads.pending_chunks == 0
        assert len(reader.l3.load_prefix(NS, [b.block_hash for b in session[:3 * K]])) == 3 * K
        _register(reader, session[:3 * K])
        assert reader.uploads.pending_chunks == 0 and calls == Counter(head=3, put=3)
    finally:
        await index_fed.close()
        await reader.close()

    # A worker told nothing asks once per chunk (HEAD finds each), then never again.
    asker = _worker(_fresh_worker_store(store), fp)
    try:
        for _ in range(2):
            _register(asker, session[:3 * K])
            assert await asker.uploads.join(timeout_s=30)
        assert calls == Counter(head=6, put=3)
        assert (asker.uploads.stats.chunks_existing, asker.uploads.stats.chunks_known) == (3, 3)
    finally:
        await asker.close()


async def test_a_quarantined_chunk_is_forgotten_and_written_again(s3_server, make_chain, fp) -> None:
    store = _store(s3_server, fp)
    blocks = make_chain(K, seed=2)
    tiers = _worker(store, fp)
    try:
        _register(tiers, blocks)
        assert await tiers.uploads.join(timeout_s=30)
        key = _key(store, blocks, K)
        body = bytearray(store.client.get_object(store.bucket, key).read())
        body[-40] ^= 0x01
        store.client.put_object(store.bucket, key, io.BytesIO(bytes(body)), len(body))
        assert store.get_chunk(key).reason is MissReason.CHECKSUM  # deleted, and no longer "known"
        puts = store.client.calls["put"]
        _register(tiers, blocks)
        assert await tiers.uploads.join(timeout_s=30)
        assert store.client.calls["put"] == puts + 1
        assert not isinstance(store.get_chunk(key), Miss)
    finally:
        await tiers.close()


async def test_a_chain_ten_times_the_queue_budget_lands_whole(s3_server, make_chain, fp) -> None:
    """The queue holds references to L2 (shared memory here), not bytes: no size cap drops a chain."""
    store = _store(s3_server, fp)
    blocks = make_chain(10 * K, seed=3)
    chain_bytes = sum(len(encode_kv_block(b, fp)) for b in blocks)
    tiers = _worker(store, fp, max_bytes=chain_bytes // 10, shm=True)
    try:
        _register(tiers, blocks)
        assert tiers.uploads.queued_bytes <= tiers.uploads.max_bytes
        assert await tiers.uploads.join(timeout_s=60)
        stats = tiers.uploads.stats
        assert (stats.chunks_written, stats.chunks_dropped, stats.chunks_lost) == (10, 0, 0)
        assert len(store.load_prefix(NS, [b.block_hash for b in blocks])) == 10 * K
    finally:
        await tiers.close()


async def test_chunks_whose_blocks_left_l2_are_lost_with_the_rest_of_their_chain(s3_server, make_chain,
                                                                                 fp) -> None:
    store = _store(s3_server, fp)
    first, second = make_chain(3 * K, seed=4), make_chain(3 * K, seed=5)
    block_bytes = len(encode_kv_block(first[0], fp))
    tiers = _worker(store, fp, l2_bytes=3 * K * block_bytes, shm=True)
    await tiers.uploads.close()  # held back, so the second chain evicts the first one's blocks meanwhile
    try:
        _register(tiers, first)
        _register(tiers, second)
        assert not any(b.block_hash in tiers.l2 for b in first)
        tiers.uploads.start()
        assert await tiers.uploads.join(timeout_s=30)
        assert (tiers.uploads.stats.chunks_lost, tiers.uploads.stats.chunks_written) == (3, 3)
        assert store.load_prefix(NS, [b.block_hash for b in first]) == []
        assert len(store.load_prefix(NS, [b.block_hash for b in second])) == 3 * K
        assert len(list(store.client.list_objects(store.bucket, recursive=True))) == 3
        _register(tiers, first)  # exported again: the next registration fills the gap
        assert await tiers.uploads.join(timeout_s=30)
        assert len(store.load_prefix(NS, [b.block_hash for b in first])) == 3 * K
    finally:
        await tiers.close()


def test_a_shared_memory_view_outlives_eviction(make_chain, fp) -> None:
    """What the queue relies on: bytes read before L2 frees a block stay valid and unchanged (reads copy)."""
    arena = SlabArena(f"w-{uuid.uuid4().hex[:8]}", 1 << 20)
    encoded = encode_kv_block(make_chain(1, seed=6)[0], fp)
    arena.write(b"k" * 32, encoded)
    view = arena.read(b"k" * 32)
    arena.free(b"k" * 32)
    assert arena.read(b"k" * 32) is None and bytes(view) == bytes(encoded)


async def test_growing_session_writes_each_byte_about_once(s3_server, make_chain, fp) -> None:
    """30 turns, each 3 blocks longer: every full chunk once, one tail at the end (written on join)."""
    store = _store(s3_server, fp)
    session = make_chain(90, seed=7)
    tiers = _worker(store, fp)
    try:
        for turn in range(1, 31):
            _register(tiers, session[:3 * turn])
        assert await tiers.uploads.join(timeout_s=60)
    finally:
        await tiers.close()
    # The session's unique blocks as stored (the block format's header is 5% of these tiny blocks and
    # 0.01% of a real 2 MiB one: not what is measured here); the rest is chunk TOCs and rewrites.
    unique_bytes = sum(len(encode_kv_block(b, fp)) for b in session)
    amplification = store.stats.bytes_put / unique_bytes
    assert amplification <= 1.05, amplification
    assert store.client.calls == Counter(head=23, put=23)  # 22 full chunks + the final 2-block tail
    assert len(list(store.client.list_objects(store.bucket, recursive=True))) == 23
    assert len(store.load_prefix(NS, [b.block_hash for b in session])) == 90


async def test_a_tail_left_alone_lands_after_the_delay(s3_server, make_chain, fp) -> None:
    store = _store(s3_server, fp)
    blocks = make_chain(K + 2, seed=8)
    tiers = _worker(store, fp, tail_delay_s=0.2)
    tail_key = _key(store, blocks, K + 2)
    try:
        _register(tiers, blocks)
        deadline = time.monotonic() + 30
        while tail_key not in store.client.keys["put"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert tail_key in store.client.keys["put"]  # no join: the delay alone sent it
        assert await tiers.uploads.join(timeout_s=30)
        assert len(store.load_prefix(NS, [b.block_hash for b in blocks])) == K + 2
    finally:
        await tiers.close()


async def test_uploads_wait_while_the_worker_is_busy_and_run_at_the_lowest_priority(s3_server, make_chain, fp) -> None:
    """A due chunk waits while `busy` says so (a request running, a chain being stored), then goes on the
    queue's own nice-19 thread; past `max_defer_s` it goes anyway, so a steady load delays uploads, never loses them."""
    store = _store(s3_server, fp)
    tiers = _worker(store, fp)
    queue = tiers.uploads
    busy = asyncio.Event()
    busy.set()
    queue.busy = busy.is_set
    threads: list[int] = []
    write_chunk = store.write_chunk
    store.write_chunk = lambda *a, **kw: threads.append(threading.get_native_id()) or write_chunk(*a, **kw)
    try:
        session = make_chain(2 * K, seed=7)
        _register(tiers, session)
        await until(lambda: queue.holding, 10, "the first chunk held while the worker is busy")
        assert store.client.calls["put"] == 0 and queue.pending_chunks == 2
        busy.clear()
        assert await queue.join(timeout_s=30)
        assert store.client.calls["put"] == 2 and queue.stats.chunks_deferred >= 1
        assert threads and threading.get_native_id() not in threads
        if sys.platform == "linux":
            assert {thread_nice(t) for t in threads} == {LOWEST_PRIORITY}

        queue.max_defer_s = 0.0  # a worker that is never idle still uploads
        busy.set()
        _register(tiers, make_chain(K, seed=8))
        assert await queue.join(timeout_s=30) and store.client.calls["put"] == 3
    finally:
        await tiers.close()


def test_host_idle_reads_the_share_of_idle_cpu_time(tmp_path) -> None:
    stat = tmp_path / "stat"

    def write(user: int, idle: int) -> None:
        stat.write_text(f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 {user} 0 0 {idle} 0 0 0 0 0 0\n")

    write(100, 100)
    host = HostIdle(min_idle=0.5, path=str(stat))
    write(190, 110)  # 90 of 100 jiffies busy
    assert host.busy()
    assert host.busy()  # no time passed: the last answer
    write(200, 200)  # 10 busy, 90 idle
    assert not host.busy()
    assert not HostIdle(path=str(tmp_path / "absent")).busy()  # no /proc: never busy
