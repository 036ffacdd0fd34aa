"""The cache index over real NATS JetStream: workers' publishers -> KV_EVENTS -> replicas -> lookups.

Each test takes a NATS server of its own: the lookup subject is one queue group per server.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from bus.helpers import FAST_BUS, connected, eventually, unique
from kvmesh.bus.publish import Publisher
from kvmesh.bus.request import request, serve
from kvmesh.cache_index.client import lookup_prefix
from kvmesh.cache_index.messages import LookupReply, LookupRequest
from kvmesh.cache_index.service import CacheIndex
from kvmesh.config import IndexSettings
from kvmesh.kv_events.dump import DumpError, fetch_dump, serve_dump
from kvmesh.kv_events.event_log import EventLog
from kvmesh.kv_events.publisher import KVEventPublisher
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol import subjects
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.messages import Role
from kvmesh.service.heartbeat import HeartbeatLoop


def chain(n: int, salt: str) -> list[bytes]:
    return [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(n)]


def index_settings(**kw) -> IndexSettings:
    return IndexSettings(flush_interval_s=0.01, dump_timeout_s=1.0, snapshot_every_s=3600,
                         snapshot_name=unique("snap"), **kw)


@asynccontextmanager
async def replica(url: str, settings: IndexSettings, watch: bool = False,
                  write_snapshot: bool = False) -> AsyncIterator[CacheIndex]:
    """A CacheIndex on its own connection, answering INDEX_LOOKUP in the shared queue group."""
    async with connected(url, "index") as nc:
        index = CacheIndex(nc, nc.jetstream(), settings, watch=watch)
        await index.start()
        responder = await serve(nc, subjects.INDEX_LOOKUP, LookupRequest, index.lookup, queue="cache-index")
        try:
            yield index
        finally:
            await responder.drain()
            await index.stop(write_snapshot=write_snapshot)


async def publish_next(js, log: EventLog) -> None:
    """Put the log's next batch in the stream, as the worker's publisher would."""
    batch = log.take_batch()
    await js.publish(subjects.kv_events(log.worker_id), batch.to_bytes())
    log.published(batch.last_seq)


def lose_next(log: EventLog) -> None:
    """The log's next batch never reaches the stream (the worker believes it did)."""
    log.published(log.take_batch().last_seq)


def answer(index: CacheIndex, hashes: list[bytes]) -> dict[str, int]:
    res = index.state.index.lookup([int.from_bytes(h[:8], "big") for h in hashes])
    return {w: m.blocks for w, m in res.workers.items()}


async def test_two_replicas_converge_and_answer_lookups_over_nats(fresh_nats_server):
    url, s = fresh_nats_server.url, index_settings()
    a_chain, b_chain = chain(12, "a"), chain(12, "a")[:5] + chain(7, "b")
    async with connected(url, "workers") as nc, replica(url, s) as r1, replica(url, s) as r2:
        pub = Publisher(nc.jetstream(), FAST_BUS)
        wa, wb = KVEventPublisher(pub, unique("wa"), s), KVEventPublisher(pub, unique("wb"), s)
        await wa.start(nc)
        await wb.start(nc)
        for i, h in enumerate(a_chain):  # the engine stores block by block: one coalesced event
            wa.block_stored(h, a_chain[i - 1] if i else None, 16)
        wb.stored(b_chain[:8], Tier.L2, tokens_per_block=16)
        wb.moved(b_chain[:3], Tier.L2, Tier.L1)
        wa.moved(a_chain[8:], Tier.L1, Tier.L3)  # demoted to object storage
        await wa.flushed()
        await wb.flushed()
        want = {wa.worker_id: 8, wb.worker_id: 5}
        await eventually(lambda: answer(r1, a_chain) == want and answer(r2, a_chain) == want, 10, "replicas converge")
        reply = await request(nc, subjects.INDEX_LOOKUP, LookupRequest(hashes=[h.hex() for h in a_chain]),
                              LookupReply, timeout_s=2.0)
        assert reply.ready and reply.l3_blocks == 0  # L3 holds blocks 8.. only: no leading run
        assert [(m.worker, m.blocks) for m in reply.workers] == [(wa.worker_id, 8), (wb.worker_id, 5)]
        assert [(r.tier, r.blocks) for r in reply.workers[1].runs] == [(Tier.L1, 3), (Tier.L2, 2)]
        routed = await lookup_prefix(nc, b_chain, timeout_s=2.0)  # the router's call
        assert routed is not None and {m.worker: m.blocks for m in routed.workers} == {wb.worker_id: 8, wa.worker_id: 5}
        tail = await request(nc, subjects.INDEX_LOOKUP, LookupRequest(hashes=[]), LookupReply, timeout_s=2.0)
        assert tail.workers == [] and tail.indexed_blocks == len(r1.state.index) == len(r2.state.index)
        assert r1.state.index.masks.keys() == r2.state.index.masks.keys()
        await wa.stop()
        await wb.stop()


async def test_sequence_gap_is_repaired_by_a_chunked_state_dump(fresh_nats_server):
    url, s = fresh_nats_server.url, index_settings()
    worker = unique("w")
    big = chain(20_000, "big")  # > one chunk under the default 1 MB max_payload
    async with connected(url, "worker") as nc, replica(url, s) as idx:
        js = nc.jetstream()
        log = EventLog(worker, max_batch_hashes=50_000)
        dump_sub = await serve_dump(nc, worker, log.state_dump)
        log.cleared()
        await publish_next(js, log)
        log.stored(big, Tier.L2, tokens_per_block=16)
        lose_next(log)
        log.stored(chain(3, "after"), Tier.L1, tokens_per_block=16)
        await publish_next(js, log)
        await eventually(lambda: answer(idx, big).get(worker) == len(big), 10, "gap repaired by the dump")
        assert answer(idx, chain(3, "after")) == {worker: 3}
        assert idx.state.gaps() == [] and idx.state.feeds[worker].next_seq == log.seq + 1
        await dump_sub.unsubscribe()


async def test_a_lost_last_event_is_found_from_the_heartbeat_and_repaired(fresh_nats_server):
    """No later event shows the gap: the worker's heartbeat says how far its events are in the stream."""
    url, s = fresh_nats_server.url, index_settings(lag_grace_s=1.0)
    worker, blocks = unique("w"), chain(5, "last")
    async with connected(url, "worker") as nc, replica(url, s, watch=True) as idx:
        js = nc.jetstream()
        log = EventLog(worker)
        dump_sub = await serve_dump(nc, worker, log.state_dump)
        log.cleared()
        await publish_next(js, log)
        log.stored(blocks, Tier.L1, tokens_per_block=16)
        lose_next(log)  # the worker's last event: nothing after it shows the gap
        beat = HeartbeatLoop(js, worker, Role.PREFILL, "http://127.0.0.1:1", interval_s=0.3, ttl_s=5.0,
                             metrics=ServiceMetrics.create("test"),
                             kv_position=lambda: (log.epoch, log.published_seq))
        beating = asyncio.create_task(beat.run())
        await eventually(lambda: answer(idx, blocks).get(worker) == 5, 15, "the lost blocks indexed after a dump")
        assert idx.state.gaps() == [] and idx.state.feeds[worker].next_seq == log.seq + 1
        beat.stop()
        await beating
        await dump_sub.unsubscribe()


async def test_dead_worker_entries_are_purged_when_its_heartbeat_lapses(fresh_nats_server):
    url, s = fresh_nats_server.url, index_settings()
    dead, alive = unique("dead"), unique("alive")
    blocks = chain(6, "p")
    async with connected(url, "workers") as nc, replica(url, s, watch=True) as idx:
        js = nc.jetstream()
        pub = Publisher(js, FAST_BUS)
        beats = {w: HeartbeatLoop(js, w, Role.DECODE, "http://127.0.0.1:1", interval_s=0.3, ttl_s=1.0,
                                  metrics=ServiceMetrics.create("test")) for w in (dead, alive)}
        tasks = [asyncio.create_task(b.run()) for b in beats.values()]
        events = {w: KVEventPublisher(pub, w, s) for w in (dead, alive)}
        for e in events.values():
            await e.start(nc)
            e.stored(blocks, Tier.L1, tokens_per_block=16)
            await e.flushed()
        await eventually(lambda: answer(idx, blocks) == {dead: 6, alive: 6}, 10, "both indexed")
        beats[dead].stop()  # a crash: no more heartbeats, no goodbye
        await eventually(lambda: answer(idx, blocks) == {alive: 6}, 8, "dead worker purged")
        assert dead not in idx.state.index.slots
        beats[alive].stop()
        await asyncio.gather(*tasks)
        for e in events.values():
            await e.stop()


async def test_a_replica_started_after_a_worker_died_purges_it_once_ready(fresh_nats_server):
    url, s = fresh_nats_server.url, index_settings()
    ghost, live = unique("ghost"), unique("live")
    blocks = chain(4, "g")
    async with connected(url, "workers") as nc:
        js = nc.jetstream()
        beat = HeartbeatLoop(js, live, Role.DECODE, "http://127.0.0.1:1", interval_s=0.3, ttl_s=2.0,
                             metrics=ServiceMetrics.create("test"))
        beating = asyncio.create_task(beat.run())
        pub = Publisher(js, FAST_BUS)
        events = {w: KVEventPublisher(pub, w, s) for w in (ghost, live)}
        for e in events.values():  # the ghost published, then died before any index watched
            await e.start(nc)
            e.stored(blocks, Tier.L1, tokens_per_block=16)
            await e.flushed()
            await e.stop()
        async with replica(url, s, watch=True) as idx:
            await eventually(lambda: idx.ready and answer(idx, blocks) == {live: 4}, 10, "the ghost purged")
        beat.stop()
        await beating


async def test_snapshot_then_replay_restores_the_same_state(fresh_nats_server):
    url, s = fresh_nats_server.url, index_settings()
    workers = [unique("w") for _ in range(3)]
    async with connected(url, "workers") as nc:
        pub = Publisher(nc.jetstream(), FAST_BUS)
        events = [KVEventPublisher(pub, w, s) for w in workers]
        for i, e in enumerate(events):
            await e.start(nc)
            e.stored(chain(50, f"s{i}"), Tier.L1, tokens_per_block=16)
            await e.flushed()
        async with replica(url, s) as first:
            await eventually(lambda: len(first.state.index) == 150, 10, "first replica indexed")
            snap = await first.write_snapshot()
            assert snap.stream_seq == first.state.stream_seq and snap.blocks == 150
            for i, e in enumerate(events):  # after the snapshot: only the replay carries these
                e.moved(chain(10, f"s{i}"), Tier.L1, Tier.L2)
                e.removed(chain(50, f"s{i}")[40:], Tier.L1)
                await e.flushed()
            await eventually(lambda: first.state.stream_seq >= snap.stream_seq + 3, 10, "first saw the tail")
            async with replica(url, s) as second:
                await eventually(lambda: second.ready, 10, "second replica ready")
                assert second.messages_read == first.state.stream_seq - snap.stream_seq  # the tail only
                assert second.state.events_applied == first.state.events_applied
                holders = lambda r: {k: r.state.index.holders(k) for k in r.state.index.masks}  # noqa: E731
                assert holders(second) == holders(first) and len(second.state.index) == 120
                probe = chain(50, "s1")
                assert answer(second, probe) == answer(first, probe) == {workers[1]: 40}
        for e in events:
            await e.stop()


async def test_dump_of_a_missing_worker_fails_fast(fresh_nats_server):
    async with connected(fresh_nats_server.url, "index") as nc:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(DumpError, match="no responders"):
            await fetch_dump(nc, unique("gone"), timeout_s=3.0)
        assert loop.time() - t0 < 1.0


async def test_router_lookup_degrades_to_none_without_an_index(fresh_nats_server):
    async with connected(fresh_nats_server.url, "router") as nc:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await lookup_prefix(nc, chain(3, "x"), timeout_s=0.5) is None
        assert loop.time() - t0 < 0.5  # no responders: answered at once, not after the timeout


async def test_replica_keeps_consuming_after_a_nats_restart(fresh_nats_server):
    url, s = fresh_nats_server.url, index_settings()
    worker = unique("w")
    async with connected(url, "workers") as nc, replica(url, s) as idx:
        events = KVEventPublisher(Publisher(nc.jetstream(), FAST_BUS), worker, s)
        await events.start(nc)
        events.stored(chain(5, "before"), Tier.L1, tokens_per_block=16)
        await events.flushed()
        await eventually(lambda: answer(idx, chain(5, "before")) == {worker: 5}, 10, "indexed before")
        fresh_nats_server.stop()
        fresh_nats_server.start()
        events.stored(chain(5, "after"), Tier.L2, tokens_per_block=16)
        await events.flushed(timeout_s=20)
        await eventually(lambda: answer(idx, chain(5, "after")) == {worker: 5}, 30, "indexed after the restart")
        assert answer(idx, chain(5, "before")) == {worker: 5}
        await events.stop()
