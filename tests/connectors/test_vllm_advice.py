"""The eviction service's advice applied by the connector of a kvmesh worker running vLLM (no vLLM here).

The connector's store with a real S3 server (and, for the consumer, the session's NATS server): a prefetch
brings a session's chain back into L2 from L3 or from the owner's slab and pins it within the L2 pin budget,
pinned blocks survive demotes and drops, warm fills L2 from named chunks, L1 advice is skipped, and a command
published on the bus reaches the store through the worker's own durable consumer.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from bus.helpers import connected, eventually
from kvmesh.bus.publish import Publisher
from kvmesh.config import BusSettings, PinQuotaSettings, Settings
from kvmesh.connectors.vllm.advice import ConnectorAdvice
from kvmesh.connectors.vllm.store import WorkerStore
from kvmesh.eviction.messages import Demote, Drop, Retain, Warm, WorkerCommand
from kvmesh.protocol import subjects
from kvmesh.protocol.blocks import Tier
from kvmesh.serving.pinning import L2Pins
from kvmesh.tiers.namespace import namespace_for
from test_vllm_store import BLOCK, FP, chain

BLOCK_BYTES = 4096


def advice_for(store: WorkerStore, l2_fraction: float = 1.0) -> ConnectorAdvice:
    quota = PinQuotaSettings(l2_fraction=l2_fraction, l2_tenant_fraction=l2_fraction)
    return ConnectorAdvice(store, L2Pins.for_tier(quota, store.l2.capacity_bytes, store.block_bytes))


def command(cmd) -> WorkerCommand:
    return WorkerCommand(worker="w", command_id=uuid.uuid4().hex, command=cmd)


def retain(hashes: list[bytes], fetch: bool, owner: str = "") -> WorkerCommand:
    return command(Retain(hashes=[h.hex() for h in hashes], until=time.time() + 600, fetch=fetch, owner=owner,
                          session_id="s1"))


@pytest.fixture
def stores(settings):
    made: list[WorkerStore] = []

    def make(s: Settings = settings, fleet_role: str = "vllm") -> WorkerStore:
        made.append(WorkerStore(s, f"vllm-adv-{uuid.uuid4().hex[:8]}", FP, BLOCK, BLOCK_BYTES, fleet_role=fleet_role))
        return made[-1]

    yield make
    for store in reversed(made):
        store.close()


def test_a_prefetch_brings_a_session_back_from_l3_and_pins_it(stores) -> None:
    first = stores()
    blocks = chain(6, seed=11)
    hashes = [b.block_hash for b in blocks]
    first.keep("", hashes, {b.block_hash: b for b in blocks})
    assert first.drain(30)

    store = stores()  # a restarted worker: L2 empty, the chain in L3
    advice = advice_for(store)
    res = asyncio.run(advice.apply(retain(hashes, fetch=True)))
    assert (res.prefetched, res.retained, res.skipped) == (6, 6, 0)
    now = store.l2.clock()
    assert all(h in store.l2 and store.l2.is_pinned(h, now) for h in hashes)
    # pinned: advice to let them go is refused, block by block
    res = asyncio.run(advice.apply(command(Demote(hashes=[h.hex() for h in hashes], src=Tier.L2))))
    assert (res.moved, res.skipped) == (0, 6) and all(h in store.l2 for h in hashes)
    # a retain without fetch pins what is there and brings nothing
    res = asyncio.run(advice.apply(retain(hashes, fetch=False)))
    assert (res.prefetched, res.retained) == (0, 6)


def test_a_prefetch_reads_the_owners_slab_and_stops_at_the_first_block_nowhere(stores, settings) -> None:
    no_l3 = settings.model_copy(update={"tiers": settings.tiers.model_copy(update={"l3_enabled": False})})
    owner, store = stores(no_l3), stores(no_l3)
    blocks = chain(5, seed=12)
    hashes = [b.block_hash for b in blocks]
    owner.keep("", hashes[:3], {b.block_hash: b for b in blocks[:3]})
    advice = advice_for(store)
    res = asyncio.run(advice.apply(retain(hashes, fetch=True, owner=owner.l2.worker_id)))
    assert (res.prefetched, res.retained, res.skipped) == (3, 3, 2)
    assert [h in store.l2 for h in hashes] == [True] * 3 + [False] * 2
    # unnamed, the owner's slab is not read
    other = stores(no_l3)
    res = asyncio.run(advice_for(other).apply(retain(hashes, fetch=True)))
    assert (res.prefetched, res.retained) == (0, 0)


def test_pins_stay_within_the_l2_pin_budget_and_unpinned_blocks_go(stores, settings) -> None:
    small = settings.model_copy(update={"tiers": settings.tiers.model_copy(
        update={"l3_enabled": False, "l2_capacity_bytes": 10 * BLOCK_BYTES})})
    store = stores(small)
    blocks = chain(6, seed=13)
    hashes = [b.block_hash for b in blocks]
    store.keep("", hashes, {b.block_hash: b for b in blocks})
    held = store.held(hashes)
    assert held >= 4
    res = asyncio.run(advice_for(store, l2_fraction=0.3).apply(retain(hashes, fetch=False)))
    pinned = res.retained
    assert 0 < pinned < held  # 30% of L2's bytes: fewer blocks than L2 holds
    res = asyncio.run(advice_for(store).apply(command(Drop(hashes=[h.hex() for h in hashes[:held]], tier=Tier.L2))))
    assert (res.dropped, res.skipped) == (held - pinned, pinned)
    assert [h in store.l2 for h in hashes[:held]] == [True] * pinned + [False] * (held - pinned)
    # vLLM's pool is vLLM's: L1 advice changes nothing
    res = asyncio.run(advice_for(store).apply(command(Demote(hashes=[hashes[0].hex()], src=Tier.L1))))
    assert (res.moved, res.skipped) == (0, 1) and hashes[0] in store.l2


def test_warm_fills_l2_from_this_models_chunks_only(stores) -> None:
    first = stores()
    blocks = chain(4, seed=14)
    hashes = [b.block_hash for b in blocks]
    first.keep("", hashes, {b.block_hash: b for b in blocks})
    assert first.drain(30)
    store = stores()
    ns = namespace_for("")
    keys = [store.l3.key(ns, hashes[i]) for i in (1, 3)]  # two chunks of two blocks
    res = asyncio.run(advice_for(store).apply(command(Warm(keys=[*keys, "another-model/x"]))))
    assert (res.warmed, res.skipped) == (4, 1)
    assert all(h in store.l2 for h in hashes)


def test_a_command_on_the_bus_reaches_the_store_through_the_workers_consumer(nats_server, settings) -> None:
    async def declare_streams() -> None:
        async with connected(nats_server.url):
            pass

    asyncio.run(declare_streams())
    bus = settings.model_copy(update={"nats_url": nats_server.url})
    first = WorkerStore(bus, f"vllm-adv-{uuid.uuid4().hex[:8]}", FP, BLOCK, BLOCK_BYTES)
    worker_id = f"prefill-adv-{uuid.uuid4().hex[:8]}"
    blocks = chain(4, seed=15)
    hashes = [b.block_hash for b in blocks]
    try:
        first.keep("", hashes, {b.block_hash: b for b in blocks})
        assert first.drain(30)
    finally:
        first.close()

    async def publish_and_wait(store: WorkerStore) -> None:
        async with connected(nats_server.url) as nc:
            cmd = WorkerCommand(worker=worker_id, command_id=f"prefetch-{uuid.uuid4().hex}",
                                command=Retain(hashes=[h.hex() for h in hashes], until=time.time() + 600, fetch=True))
            await Publisher(nc.jetstream(), BusSettings()).publish(subjects.commands(worker_id), cmd,
                                                                   msg_id=cmd.command_id)
            await eventually(lambda: store.held(hashes) == len(hashes), 30, "the prefetched chain in L2")

    store = WorkerStore(bus, worker_id, FP, BLOCK, BLOCK_BYTES, fleet_role="prefill")
    try:
        advice = advice_for(store)
        store.take_commands(advice.on_message)
        asyncio.run(publish_and_wait(store))
        now = store.l2.clock()
        assert all(store.l2.is_pinned(h, now) for h in hashes) and advice.applied.prefetched == 4
    finally:
        store.close()
