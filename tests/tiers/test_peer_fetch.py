"""Peer fetch over HTTP and over NATS: bit-exact, misses counted, a lying peer is never served."""

from __future__ import annotations

import os

import nats
import torch
from fastapi import FastAPI
from kvmesh.cache_policy.base import LRUPolicy
from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.miss import Miss, MissCounters, MissReason
from kvmesh.transfer.peer_http import HttpPeerClient, peer_router, serve_in_loop
from kvmesh.transfer.peer_nats import NatsPeerClient, NatsPeerServer


def _same(a, b) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _owner(make_chain, fp) -> tuple[HostTier, list]:
    tier = HostTier(1 << 30, LRUPolicy(), fp, worker_id="owner")
    blocks = make_chain(5, shape=(2, 2, 16, 4, 64))  # 32 KiB blocks: several NATS chunks below
    for b in blocks:
        tier.put_block(b)
    return tier, blocks


async def _check(client, tier, blocks) -> None:
    for b in blocks:
        got = await client.fetch("owner", b.block_hash)
        assert not isinstance(got, Miss) and _same(got.to_kv_block().data, b.data)
    assert (await client.fetch("owner", bytes(32))).reason is MissReason.NOT_FOUND
    # The owner's memory goes bad: the bytes travel, the receiver refuses them.
    stored = tier.arena._bufs[blocks[0].block_hash]
    stored[len(stored) // 2] ^= 0x04
    assert (await client.fetch("owner", blocks[0].block_hash)).reason is MissReason.CHECKSUM
    assert client.counters.get(Tier.PEER, MissReason.CHECKSUM) == 1
    assert client.counters.get(Tier.PEER, MissReason.NOT_FOUND) == 1


async def test_http_peer_fetch(make_chain, fp) -> None:
    tier, blocks = _owner(make_chain, fp)
    app = FastAPI()
    app.include_router(peer_router(tier))
    async with serve_in_loop(app) as url:
        client = HttpPeerClient(lambda worker: url, fp, MissCounters())
        try:
            await _check(client, tier, blocks)
        finally:
            await client.close()
    gone = HttpPeerClient(lambda worker: url, fp, MissCounters(), timeout_s=1.0)
    assert (await gone.fetch("owner", blocks[1].block_hash)).reason is MissReason.UNAVAILABLE
    await gone.close()


async def test_nats_peer_fetch_in_chunks(nats_server, make_chain, fp) -> None:
    tier, blocks = _owner(make_chain, fp)
    nc = await nats.connect(nats_server.url)
    server = NatsPeerServer(nc, tier, "owner", chunk_bytes=10_000)  # 32 KiB block -> 4 messages
    client = NatsPeerClient(nc, fp, MissCounters(), timeout_s=2.0)
    await server.start()
    await client.start()
    try:
        await _check(client, tier, blocks)
        await server.stop()
        client.timeout_s = 0.3
        assert (await client.fetch("owner", blocks[1].block_hash)).reason is MissReason.UNAVAILABLE
    finally:
        await client.close()
        await nc.close()


async def test_shm_peer_then_network_fallback(nats_server, make_chain, fp) -> None:
    from kvmesh.tiers.shm_slab import SlabArena
    from kvmesh.transfer.peer_shm import ShmPeerClient

    owner = f"owner-{os.getpid()}"  # slab names are machine-wide
    shm_tier = HostTier(1 << 30, LRUPolicy(), fp, worker_id=owner, arena=SlabArena(owner, 1 << 30))
    net_tier = HostTier(1 << 30, LRUPolicy(), fp, worker_id=owner)
    blocks = make_chain(3)
    shm_tier.put_block(blocks[0])  # on this machine, in shared memory
    net_tier.put_block(blocks[1])  # only reachable over NATS
    nc = await nats.connect(nats_server.url)
    server = NatsPeerServer(nc, net_tier, owner)
    net = NatsPeerClient(nc, fp, MissCounters(), timeout_s=2.0)
    await server.start()
    await net.start()
    try:
        local_only = ShmPeerClient(fp, MissCounters())
        assert _same((await local_only.fetch(owner, blocks[0].block_hash)).to_kv_block().data, blocks[0].data)
        assert (await local_only.fetch(owner, blocks[1].block_hash)).reason is MissReason.NOT_FOUND
        both = ShmPeerClient(fp, MissCounters(), fallback=net)
        assert _same((await both.fetch(owner, blocks[1].block_hash)).to_kv_block().data, blocks[1].data)
        assert (await both.fetch(owner, blocks[2].block_hash)).reason is MissReason.NOT_FOUND
    finally:
        shm_tier.close()
        await net.close()
        await nc.close()
