"""The windowed KV fetch: cache transparency with blocks from L1, L2, a peer and L3; stop at the first hole.

In process, with the real pieces: the engine on its thread, host tiers, the
NATS peer server/client against the session nats-server, L3 against the
session S3 server, and `WorkerTiers` as the workers build them.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator

import nats
import pytest
from bus.helpers import FAST_BUS, connected, eventually
from kvmesh.bus.publish import Publisher
from kvmesh.bus.request import serve
from kvmesh.cache_index.messages import LookupRequest
from kvmesh.cache_index.service import CacheIndex
from kvmesh.cache_policy.base import LRUPolicy
from kvmesh.config import EngineSettings, IndexSettings, Settings
from kvmesh.engine.engine import Engine
from kvmesh.engine.sampling import SamplingParams
from kvmesh.kv_events.publisher import KVEventPublisher
from kvmesh.protocol import subjects
from kvmesh.protocol.blocks import Tier
from kvmesh.serving.engine_loop import EngineLoop, RequestSpec
from kvmesh.serving.kv_fetch import (
    L2Source,
    L3Source,
    PeerSource,
    cached_run,
    fetch_chain,
)
from kvmesh.serving.prefix_reach import reach_prefix
from kvmesh.serving.worker_tiers import WorkerTiers, namespace_for
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.miss import MissCounters
from kvmesh.tiers.s3_client import fast_fail_client
from kvmesh.transfer.peer_nats import NatsPeerClient, NatsPeerServer

from .harness import BLOCK_SIZE, SALT_A

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 8
TEXT = "Windows of the chain arrive from host memory, a peer and object storage, in order. " * 6


@pytest.fixture
async def engine(tiny_loaded) -> AsyncIterator[EngineLoop]:
    loop = EngineLoop(Engine(tiny_loaded, EngineSettings(block_size=BLOCK_SIZE, num_blocks=256)))
    loop.start()
    yield loop
    loop.stop()


def _compute(tiny_loaded, salt: bytes = b"", blocks: int | None = None):
    """TEXT as a worker that computed it for tenant `salt` holds it: the prompt, the hashes of its first
    `blocks` full blocks (all by default), and those blocks as the worker exports them."""
    prompt = tiny_loaded.tokenizer.encode(TEXT)
    src = Engine(tiny_loaded, EngineSettings(block_size=BLOCK_SIZE, num_blocks=256))
    src.generate([prompt], SamplingParams(max_tokens=1), tenant_salt=salt)
    hashes = src.block_hashes(prompt, salt)[:blocks]
    return prompt, hashes, src.export_blocks(hashes)


@pytest.fixture(scope="module")
def computed(tiny_loaded):
    """A prompt of more than 12 usable blocks, its hashes and its blocks as a worker that computed it exports them."""
    usable = (len(tiny_loaded.tokenizer.encode(TEXT)) - 1) // BLOCK_SIZE
    assert usable >= 12
    return _compute(tiny_loaded, blocks=usable)


def _l3(s3_server, fp: str, chunk_blocks: int) -> L3Store:
    store = L3Store(fast_fail_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key),
                    f"fetch-{uuid.uuid4().hex[:10]}", fp, chunk_blocks=chunk_blocks)
    store.ensure_bucket()
    return store


async def _run(engine: EngineLoop, rid: str, prompt: list[int]):
    return await engine.run_request(RequestSpec(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS)), lambda _: None)


async def test_chain_from_l1_l2_peer_and_l3_matches_reference(engine, computed, tiny_loaded, nats_server, s3_server,
                                                              reference):
    prompt, hashes, blocks = computed
    fp = tiny_loaded.fingerprint
    own = HostTier(1 << 28, LRUPolicy(), fp, "me")
    peer = HostTier(1 << 28, LRUPolicy(), fp, "peer")
    for b in blocks[1:4]:
        own.put_block(b)
    for b in blocks[4:8]:
        peer.put_block(b)
    l3 = _l3(s3_server, fp, chunk_blocks=4)
    l3.put_chain("ns", [encode_kv_block(b, fp) for b in blocks])  # the peer's and L2's blocks too: never asked
    nc = await nats.connect(nats_server.url)
    server = NatsPeerServer(nc, peer, "peer")
    client = NatsPeerClient(nc, fp, MissCounters())
    await server.start()
    await client.start()
    try:
        await engine.call(lambda e: e.import_blocks(blocks[:1]))  # L1: found in the engine, not fetched
        all_hashes, l1 = await cached_run(engine, prompt, b"", len(hashes), lease="req")
        assert l1 == 1 and all_hashes[:len(hashes)] == hashes
        sources = [L2Source(own), PeerSource(client, lambda p: ("peer",)), L3Source(l3, "ns", search_partial=True)]
        fetched = await fetch_chain(engine, hashes, l1, len(hashes), sources, tenant_salt=b"", lease="req",
                                    window_blocks=4, inflight=2)
        assert fetched.sources == Counter({Tier.L2: 3, Tier.PEER: 4, Tier.L3: len(hashes) - 8})
        assert fetched.hashes == hashes[1:]
        assert await engine.call(lambda e: e.leases.held("req")) == len(hashes)
        out = await _run(engine, "req", prompt)
    finally:
        await client.close()
        await server.stop()
        await nc.close()
    assert out.cached_tokens == len(hashes) * BLOCK_SIZE
    assert out.token_ids == reference(prompt, MAX_TOKENS)
    assert await engine.call(lambda e: len(e.leases)) == 0


async def test_fetch_stops_at_the_first_missing_block(engine, computed, tiny_loaded, s3_server):
    prompt, hashes, blocks = computed
    fp = tiny_loaded.fingerprint
    own = HostTier(1 << 28, LRUPolicy(), fp, "me")
    for i, b in enumerate(blocks[:10]):
        if i != 4:
            own.put_block(b)
    empty_l3 = _l3(s3_server, fp, chunk_blocks=2)  # holds nothing: misses (and probes) fill no hole
    sources = [L2Source(own), L3Source(empty_l3, "ns", search_partial=True)]
    fetched = await fetch_chain(engine, hashes, 0, 10, sources, tenant_salt=b"", lease="x", window_blocks=2,
                                inflight=3)
    assert fetched.sources == Counter({Tier.L2: 4})
    assert fetched.hashes == hashes[:4]
    assert await engine.call(lambda e: (len(e.cache.lookup(hashes, prompt)), hashes[5] in e.cache)) == (4, False)
    assert await engine.call(lambda e: e.leases.held("x")) == 4
    engine.release_lease("x")
    assert await engine.call(lambda e: "x" in e.leases) is False


async def test_fetch_stops_where_the_pool_is_full(tiny_loaded, computed):
    """What the engine does not take ends the chain; only what landed is counted."""
    prompt, hashes, blocks = computed
    fp = tiny_loaded.fingerprint
    own = HostTier(1 << 28, LRUPolicy(), fp, "me")
    for b in blocks:
        own.put_block(b)
    small = EngineLoop(Engine(tiny_loaded, EngineSettings(block_size=BLOCK_SIZE, num_blocks=7)))
    small.start()
    try:
        fetched = await fetch_chain(small, hashes, 0, len(hashes), [L2Source(own)], tenant_salt=b"", lease=None,
                                    window_blocks=2, inflight=2)
        # Without a lease of the caller's, the chain is held while it is fetched (its start is never
        # evicted to make room for its end), and not after.
        assert fetched.sources == Counter({Tier.L2: 7}) and len(fetched.hashes) == 7
        assert await small.call(lambda e: (len(e.cache.lookup(hashes, prompt)), len(e.leases))) == (7, 0)
    finally:
        small.stop()


def _settings(s3_server, bucket: str) -> Settings:
    return Settings(s3_endpoint=s3_server.endpoint, s3_access_key=s3_server.access_key,
                    s3_secret_key=s3_server.secret_key, s3={"bucket": bucket},
                    tiers={"l2_shared_memory": False, "l3_chunk_tokens": 4 * BLOCK_SIZE})


async def test_prefill_reaches_the_named_worker_then_l3(tiny_loaded, nats_server, s3_server, reference):
    """reach_prefix: the worker the router names is asked over the network; a worker named nowhere finds L3."""
    bucket = f"reach-{uuid.uuid4().hex[:10]}"
    s3_server.ensure_bucket(bucket)
    settings = _settings(s3_server, bucket)
    fp = tiny_loaded.fingerprint
    salt = bytes.fromhex(SALT_A)
    prompt, hashes, blocks = _compute(tiny_loaded, salt)
    usable = (len(prompt) - 1) // BLOCK_SIZE
    nc = await nats.connect(nats_server.url)
    owner = await WorkerTiers.start(settings, nc, "owner", fp, BLOCK_SIZE)
    here = await WorkerTiers.start(settings, nc, "here", fp, BLOCK_SIZE)
    loops = [EngineLoop(Engine(tiny_loaded, EngineSettings(block_size=BLOCK_SIZE, num_blocks=256))) for _ in range(3)]
    for loop in loops:
        loop.start()
    try:
        handles, _ = owner.register(hashes, blocks, SALT_A)
        assert len(handles) == len(hashes)
        assert await owner.uploads.join(timeout_s=30)

        reach = await reach_prefix(loops[0], here, [], prompt, SALT_A, prefix_worker="owner", lease="p")
        assert reach.sources == Counter({Tier.L1: 0, Tier.PEER: usable})
        out = await loops[0].run_request(RequestSpec("p", prompt, SamplingParams(max_tokens=MAX_TOKENS), salt),
                                         lambda _: None)
        assert out.cached_tokens == usable * BLOCK_SIZE and out.token_ids == reference(prompt, MAX_TOKENS)

        # With `nc` the cache index is asked too; none runs here, so no answer: L3 is asked all the same.
        reach = await reach_prefix(loops[1], here, [], prompt, SALT_A, nc, lease="q")
        assert reach.sources == Counter({Tier.L1: 0, Tier.L3: usable})
        out = await loops[1].run_request(RequestSpec("q", prompt, SamplingParams(max_tokens=MAX_TOKENS), salt),
                                         lambda _: None)
        assert out.cached_tokens == usable * BLOCK_SIZE and out.token_ids == reference(prompt, MAX_TOKENS)

        # The job carries the index's answer from routing (PrefillJob.l3_blocks: the first chunk, 4 blocks):
        # the GETs stop there, and the index is not asked again.
        asked: list[bytes] = []

        async def count(msg) -> None:
            asked.append(msg.data)

        await nc.subscribe(subjects.INDEX_LOOKUP, cb=count)
        reach = await reach_prefix(loops[2], here, [], prompt, SALT_A, nc, lease="s", l3_blocks=4)
        assert reach.sources == Counter({Tier.L1: 0, Tier.L3: 4})
        await nc.flush()  # a lookup sent during the reach would be delivered to `count` before the flush returns
        assert asked == []
        loops[2].release_lease("s")
    finally:
        for loop in loops:
            loop.stop()
        await owner.close()
        await here.close()
        await nc.close()


async def test_a_ready_index_bounds_the_l3_gets_and_marks_known_chunks(tiny_loaded, fresh_nats_server, s3_server):
    """The index says L3 holds the first 8 blocks: the reach stops there (no GET past it, even though this
    L3 holds more: the index is believed), and the tiers learn the 2 full chunks need no upload."""
    bucket = f"index-{uuid.uuid4().hex[:10]}"
    s3_server.ensure_bucket(bucket)
    fp = tiny_loaded.fingerprint
    prompt, hashes, blocks = _compute(tiny_loaded, bytes.fromhex(SALT_A))
    ns = namespace_for(SALT_A)
    index_settings = IndexSettings(flush_interval_s=0.01, snapshot_every_s=3600, snapshot_name=f"s-{bucket}")
    async with connected(fresh_nats_server.url, "index") as inc, connected(fresh_nats_server.url, "worker") as nc:
        index = CacheIndex(inc, inc.jetstream(), index_settings, watch=False)
        await index.start()
        responder = await serve(inc, subjects.INDEX_LOOKUP, LookupRequest, index.lookup, queue="cache-index")
        uploader = KVEventPublisher(Publisher(nc.jetstream(), FAST_BUS), "uploader", index_settings)
        await uploader.start(nc)
        here = await WorkerTiers.start(_settings(s3_server, bucket), nc, "here", fp, BLOCK_SIZE)
        loop = EngineLoop(Engine(tiny_loaded, EngineSettings(block_size=BLOCK_SIZE, num_blocks=256)))
        loop.start()
        try:
            writer = L3Store(here.l3.client, bucket, fp, chunk_blocks=here.l3.chunk_blocks)  # another worker's
            writer.put_chain(ns, [encode_kv_block(b, fp) for b in blocks])
            uploader.stored(hashes[:8], Tier.L3, tokens_per_block=BLOCK_SIZE)
            await uploader.flushed()
            await eventually(lambda: index.ready and index.state.index.lookup(
                [int.from_bytes(h[:8], "big") for h in hashes]).l3_blocks == 8, 10, "the index knows L3's 8 blocks")
            reach = await reach_prefix(loop, here, [], prompt, SALT_A, nc, lease="r")
            assert reach.sources == Counter({Tier.L3: 8})
            await eventually(lambda: here.l3.is_known(ns, hashes[7]), 5, "the index's answer reached the tiers")
            assert here.l3.is_known(ns, hashes[3]) and not here.l3.is_known(ns, hashes[11])
            loop.release_lease("r")
        finally:
            loop.stop()
            await here.close()
            await uploader.stop()
            await responder.drain()
            await index.stop(write_snapshot=False)
