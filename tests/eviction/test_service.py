"""The eviction service end to end on a real nats-server (and S3 for warm-up): events in, commands out.

A worker's real `KVEventPublisher` reports blocks; the service sends demote
advice to the over-full worker's `commands(worker)` subject (stream
COMMANDS); a pin request keeps a chain out of the advice; a new worker's
heartbeat brings a `Warm` listing the hottest L3 chunks; chunks its GC
deletes leave the cache index's L3 presence.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime

from bus.helpers import FAST_BUS, connected, eventually, unique
from kvmesh.bus.publish import Publisher
from kvmesh.bus.request import serve
from kvmesh.cache_index.index import keys_of
from kvmesh.cache_index.service import CacheIndex
from kvmesh.config import EvictionSettings, IndexSettings, SessionRetentionSettings
from kvmesh.eviction.client import pin_prefix
from kvmesh.eviction.l3_gc import scan
from kvmesh.eviction.messages import Demote, PinRequest, Retain, Warm, WorkerCommand
from kvmesh.eviction.service import EvictionService
from kvmesh.kv_events.publisher import KVEventPublisher
from kvmesh.protocol import subjects
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.messages import Heartbeat, Role
from kvmesh.protocol.streams import COMMANDS
from kvmesh.sessions.events import SessionEvent, TurnOutcome
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.l3_store import L3Store

from .helpers import chain, kv_chain, l3_store

SETTINGS = EvictionSettings(tick_s=0.1, high_water=0.9, low_water=0.5, gc_interval_s=3600,
                            sessions=SessionRetentionSettings(enabled=True))


@asynccontextmanager
async def service(url: str, l1_capacity: int, l3: L3Store | None = None):
    async with connected(url, "eviction") as nc:
        svc = EvictionService(nc, nc.jetstream(), Publisher(nc.jetstream(), FAST_BUS), SETTINGS, l1_capacity, l3)
        await svc.start()
        responder = await serve(nc, subjects.EVICTION_PIN, PinRequest, svc.pin, queue="eviction")
        try:
            yield svc
        finally:
            await responder.drain()
            await svc.stop()


@asynccontextmanager
async def worker_events(url: str, worker: str):
    async with connected(url, worker) as nc:
        pub = KVEventPublisher(Publisher(nc.jetstream(), FAST_BUS), worker, IndexSettings(flush_interval_s=0.01))
        await pub.start(nc)
        try:
            yield pub
        finally:
            await pub.stop()


async def next_command(nc, worker: str, timeout_s: float = 10.0) -> WorkerCommand:
    sub = await nc.jetstream().pull_subscribe(subjects.commands(worker), durable=unique("cmd"), stream=COMMANDS.name)
    msgs = await sub.fetch(1, timeout=timeout_s)
    await msgs[0].ack()
    return WorkerCommand.from_bytes(msgs[0].data)


async def test_over_full_worker_gets_demote_and_pins_protect(fresh_nats_server) -> None:
    url = fresh_nats_server.url
    w1, w2 = unique("w"), unique("w")
    a, b, c = chain(6, "a"), chain(6, "b"), chain(4, "c")
    async with service(url, l1_capacity=10) as svc, connected(url, "test") as nc:
        reply = await pin_prefix(nc, b, ttl_s=60, timeout_s=5)
        assert reply is not None and reply.pinned == 6 and reply.until > time.time() + 50
        async with worker_events(url, w1) as p1, worker_events(url, w2) as p2:
            p1.stored(a, Tier.L1, tokens_per_block=16)
            p1.stored(c, Tier.L1, tokens_per_block=16)  # w1: 10 of 10 blocks: over 0.9
            p2.stored(b, Tier.L1, tokens_per_block=16)
            p2.stored(c, Tier.L1, tokens_per_block=16)  # w2: 10 blocks too, but chain b is pinned
            await p1.flushed()
            await p2.flushed()
            got1 = await next_command(nc, w1)
            got2 = await next_command(nc, w2)
    assert isinstance(got1.command, Demote) and got1.command.src is Tier.L1 and got1.worker == w1
    out1 = [bytes.fromhex(h) for h in got1.command.hashes]
    assert len(out1) == 10 - 5 and len(set(out1)) == 5
    assert set(out1) <= set(a) | set(c)
    for chain_ in (a, c):  # leaf-first: what leaves of a chain is its tail
        kept = [h for h in chain_ if h not in out1]
        assert kept == chain_[:len(kept)]
    out2 = [bytes.fromhex(h) for h in got2.command.hashes]
    # Only chain c can go on w2: 4 of the 5 wanted, never a pinned block of b.
    assert set(out2) == set(c) and not set(out2) & set(b)
    assert svc.advisor.policy.name == "default"


async def test_a_session_in_a_tool_call_is_retained_on_its_worker(fresh_nats_server) -> None:
    url = fresh_nats_server.url
    worker, blocks = unique("w"), chain(5, "session")
    async with service(url, l1_capacity=100) as svc, connected(url, "test") as nc:
        async with worker_events(url, worker) as pub:
            pub.stored(blocks, Tier.L1, tokens_per_block=16)
            await pub.flushed()
        await eventually(lambda: blocks[-1] in svc.view.stats, 10, "the service saw the session's blocks")
        now = time.time()
        ev = SessionEvent(tenant="t", tenant_salt="cd" * 16, session_id="agent-1", request_id="r1",
                          outcome=TurnOutcome.TOOL_CALLS, tools=["bash"], last_hash=blocks[-1].hex(),
                          chain_blocks=5, worker=worker, expected_return_ms=2000, started_at=now - 1, at=now)
        await nc.jetstream().publish(subjects.SESSION_EVENTS, ev.to_bytes())
        got = await next_command(nc, worker)
    assert isinstance(got.command, Retain) and not got.command.fetch
    assert [bytes.fromhex(h) for h in got.command.hashes] == blocks  # the chain, from its last block back
    assert got.command.until >= now + 2
    assert all(svc.pins.pinned(h, now + 1) for h in blocks)  # the advisor keeps it too
    assert svc.retention.counts.retains == 1


async def test_forked_sessions_share_retention(fresh_nats_server) -> None:
    """A sub-agent in a tool call keeps the prefix it shares with its idle parent on the parent's worker, and
    the parent's end spares it; an unlinked pair, sent first, gets no such pin (the old behaviour)."""
    url = fresh_nats_server.url
    lead_w, sub_w, lone_lead_w, lone_sub_w = (unique(n) for n in ("lead", "sub", "lone-lead", "lone-sub"))
    shared, lone_shared = chain(5, "fork-context"), chain(5, "lone-context")
    lead, sub = shared + chain(2, "lead-tail"), shared + chain(2, "sub-tail")
    lone_lead, lone_sub = lone_shared + chain(2, "lone-lead"), lone_shared + chain(2, "lone-sub")
    async with service(url, l1_capacity=100) as svc, connected(url, "test") as nc:
        for worker, blocks in ((lead_w, lead), (sub_w, sub), (lone_lead_w, lone_lead), (lone_sub_w, lone_sub)):
            async with worker_events(url, worker) as pub:
                pub.stored(blocks, Tier.L1, tokens_per_block=16)
                await pub.flushed()
        await eventually(lambda: all(b[-1] in svc.view.stats for b in (lead, sub, lone_lead, lone_sub)), 10,
                         "the service saw every chain")
        now = time.time()

        def turn(session: str, blocks: list[bytes], worker: str, outcome: TurnOutcome, return_ms: int | None,
                 parent: str | None = None) -> bytes:
            return SessionEvent(tenant="t", tenant_salt="cd" * 16, session_id=session, request_id=unique("r"),
                                outcome=outcome, last_hash=blocks[-1].hex() if blocks else None,
                                chain_blocks=len(blocks), worker=worker, expected_return_ms=return_ms,
                                started_at=now - 1, at=now, parent_session_id=parent).to_bytes()

        js = nc.jetstream()
        idle, tool_call = (TurnOutcome.ANSWER, 600_000), (TurnOutcome.TOOL_CALLS, 2000)  # back in 10 min / 2 s
        for session, blocks, worker, (outcome, back_ms), parent in (
                ("lone-lead", lone_lead, lone_lead_w, idle, None), ("lone-sub", lone_sub, lone_sub_w, tool_call, None),
                ("lead", lead, lead_w, idle, None), ("sub", sub, sub_w, tool_call, "lead")):
            await js.publish(subjects.SESSION_EVENTS, turn(session, blocks, worker, outcome, back_ms, parent))
        on_lead = await js.pull_subscribe(subjects.commands(lead_w), durable=unique("cmd"), stream=COMMANDS.name)
        [kept] = await on_lead.fetch(1, timeout=10)
        await kept.ack()
        group = WorkerCommand.from_bytes(kept.data)
        assert isinstance(group.command, Retain) and not group.command.fetch
        assert [bytes.fromhex(h) for h in group.command.hashes] == shared  # what the two share, on the lead's worker
        assert group.command.until >= now + 2 and all(svc.pins.pinned(h, now + 1) for h in shared)
        # everything before it was handled by then: the unlinked pair's idle lead got nothing
        assert not [c for c in svc.sent if c.worker == lone_lead_w]
        assert svc.retention.counts.group_retains == 1

        await js.publish(subjects.SESSION_EVENTS, turn("lead", [], lead_w, TurnOutcome.ENDED, None))
        [ended] = await on_lead.fetch(1, timeout=10)
        await ended.ack()
        demote = WorkerCommand.from_bytes(ended.data).command
        assert isinstance(demote, Demote) and [bytes.fromhex(h) for h in demote.hashes] == lead[:4:-1]


async def test_new_worker_is_warmed_with_the_hottest_l3_chunks(fresh_nats_server, s3_server) -> None:
    url = fresh_nats_server.url
    fp = "fp-warm-0123"
    store = l3_store(s3_server, fp, chunk_blocks=2)
    cold, hot = kv_chain(4, seed=7), kv_chain(4, seed=8)
    keys = {}
    for name, blocks in (("cold", cold), ("hot", hot)):
        handles = store.put_chain("shared", [encode_kv_block(kb, fp) for kb in blocks])
        keys[name] = [h.object_key for h in handles][1::2]  # one key per chunk of 2
    gc_view = L3Store(store.client, store.bucket, fingerprint="")  # the service GCs every model's chunks
    newcomer, busy = unique("w"), unique("w")
    async with service(url, l1_capacity=1000, l3=gc_view) as svc, connected(url, "test") as nc:
        async with worker_events(url, busy) as pub:
            for _ in range(5):  # another worker keeps storing the hot prompt's blocks: it is reused
                pub.stored([kb.block_hash for kb in hot], Tier.L2, tokens_per_block=16)
            await pub.flushed()
        last = hot[-1].block_hash
        await eventually(lambda: last in svc.view.stats and svc.view.stats[last].access_count == 5, 10,
                         "the service applied the hot prompt's events")
        hb = Heartbeat(worker_id=newcomer, role=Role.DECODE, load=0.0, capacity=1.0, started_at=datetime.now(UTC),
                       http_endpoint="http://127.0.0.1:1", seq=1, ttl_s=30.0)
        await nc.jetstream().publish(subjects.heartbeat_key(newcomer), hb.to_bytes())
        got = await next_command(nc, newcomer)
    assert isinstance(got.command, Warm)
    assert set(got.command.keys) == {*keys["cold"], *keys["hot"]}
    assert set(got.command.keys[:2]) == set(keys["hot"])  # hottest first
    assert svc.l3_objects


async def test_pin_without_the_service_is_none_not_an_error(fresh_nats_server) -> None:
    async with connected(fresh_nats_server.url, "test") as nc:
        assert await pin_prefix(nc, chain(2, "x"), ttl_s=5, timeout_s=0.2) is None


async def test_gc_reports_deleted_chunks_to_the_cache_index_as_l3_removals(fresh_nats_server, s3_server) -> None:
    url, fp = fresh_nats_server.url, "fp-gc-events-01"
    store = replace(l3_store(s3_server, fp, chunk_blocks=2), ttl_s=1)
    gone, kept = kv_chain(4, seed=31), kv_chain(2, seed=32)
    store.put_chain("t", [encode_kv_block(kb, fp) for kb in gone])
    replace(store, ttl_s=3600).put_chain("t", [encode_kv_block(kb, fp) for kb in kept])
    # The service's store has the deployment's TTL (tiers.l3_ttl_s), the one the workers wrote with.
    gc_view = L3Store(store.client, store.bucket, fingerprint="", ttl_s=1)
    s = IndexSettings(flush_interval_s=0.01, snapshot_every_s=3600, snapshot_name=unique("snap"))
    async with connected(url, "eviction") as nc, worker_events(url, unique("w")) as worker:
        worker.stored([kb.block_hash for kb in gone + kept], Tier.L3, tokens_per_block=16)
        await worker.flushed()
        index = CacheIndex(nc, nc.jetstream(), s, watch=False)
        await index.start()
        events = KVEventPublisher(Publisher(nc.jetstream(), FAST_BUS), unique("eviction"), s)
        await events.start(nc)
        svc = EvictionService(nc, nc.jetstream(), Publisher(nc.jetstream(), FAST_BUS), SETTINGS, 1000, gc_view,
                              events=events)
        in_l3 = lambda blocks: index.state.index.lookup(  # noqa: E731
            keys_of([kb.block_hash.hex() for kb in blocks])).l3_blocks
        await eventually(lambda: in_l3(gone) == 4 and in_l3(kept) == 2, 10, "the worker's L3 blocks indexed")
        await eventually(lambda: time.time() > _expiry(gc_view) + 0.1, 5, "both short-TTL chunks expired")
        plan = await svc.collect()
        assert len(plan.expired) == 2
        await events.flushed()
        await eventually(lambda: in_l3(gone) == 0, 10, "the deleted chunks' blocks left the index's L3")
        assert in_l3(kept) == 2
        await events.stop()
        await index.stop(write_snapshot=False)


def _expiry(store: L3Store) -> float:
    """When the last of the 1 s TTL chunks expires (last-access is stored in whole seconds)."""
    return max(o.expires_at for o in scan(store) if o.ttl_s < 10)
