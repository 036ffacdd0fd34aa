"""The cache-index service in its real shell (ServiceRunner): readiness, lookups, worker restart, snapshot on stop."""

from __future__ import annotations

import asyncio

import httpx
from bus.helpers import FAST_BUS, connected, eventually, unique
from kvmesh.bus.publish import Publisher
from kvmesh.bus.request import request
from kvmesh.cache_index import snapshot
from kvmesh.cache_index.messages import (
    LookupReply,
    LookupRequest,
    SnapshotReply,
    SnapshotRequest,
)
from kvmesh.cache_index.service import setup_cache_index
from kvmesh.config import IndexSettings, ServiceSettings, Settings
from kvmesh.kv_events.publisher import KVEventPublisher
from kvmesh.protocol import subjects
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.messages import Role
from kvmesh.service.runner import ServiceRunner

from .test_service import chain


def _settings(url: str, snap: str) -> Settings:
    return Settings(
        nats_url=url, bus=FAST_BUS,
        service=ServiceSettings(worker_id=unique("idx"), http_port=0, heartbeat_interval_s=0.3, heartbeat_ttl_s=2.0),
        index=IndexSettings(flush_interval_s=0.01, dump_timeout_s=1.0, snapshot_name=snap),
    )


async def _lookup(nc, hashes: list[bytes]) -> LookupReply:
    return await request(nc, subjects.INDEX_LOOKUP, LookupRequest(hashes=[h.hex() for h in hashes]),
                         LookupReply, timeout_s=2.0)


async def test_service_lookups_worker_restart_and_snapshot_on_stop(fresh_nats_server):
    url, snap = fresh_nats_server.url, unique("snap")
    blocks = chain(20, "r")
    worker = unique("w")
    async with connected(url, "worker") as nc:
        runner = ServiceRunner("cache-index", Role.CACHE_INDEX, setup_cache_index, _settings(url, snap))
        task = asyncio.create_task(runner.run())
        await asyncio.wait_for(runner.wait_started(), 15)
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{runner.http_endpoint}/readyz")).status_code == 200
        pub = Publisher(nc.jetstream(), FAST_BUS)
        s = runner.settings.index
        first = KVEventPublisher(pub, worker, s, epoch=1)
        await first.start(nc)
        first.stored(blocks, Tier.L1, tokens_per_block=16)
        await first.flushed()

        async def blocks_of(w: str) -> int:
            reply = await _lookup(nc, blocks)
            return {m.worker: m.blocks for m in reply.workers}.get(w, 0)

        await eventually(lambda: blocks_of(worker), 10, "indexed")
        assert await blocks_of(worker) == 20
        await first.stop()
        second = KVEventPublisher(pub, worker, s, epoch=2)  # the same worker restarted: a new epoch
        await second.start(nc)  # publishes WorkerCleared
        second.stored(blocks[:4], Tier.L2, tokens_per_block=16)
        await second.flushed()
        await eventually(lambda: _equals(blocks_of(worker), 4), 10, "the old epoch's blocks dropped")
        done = await request(nc, subjects.INDEX_SNAPSHOT, SnapshotRequest(), SnapshotReply, timeout_s=5.0)
        assert done.blocks == 4 and done.bytes > 0
        second.stored(blocks[4:6], Tier.L2, tokens_per_block=16)
        await second.flushed()
        await eventually(lambda: _equals(blocks_of(worker), 6), 10, "indexed after the snapshot")
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"{runner.http_endpoint}/metrics")).text
        assert "kvmesh_index_blocks 6.0" in metrics and "kvmesh_index_lookup_seconds_count" in metrics
        runner.stop()  # what SIGTERM does: drain, then the final snapshot
        assert await asyncio.wait_for(task, 20) == 0
        saved = snapshot.decode(await snapshot.load(nc.jetstream(), snap))
        assert len(saved.index) == 6 and saved.feeds[worker].epoch == 2
        await second.stop()


async def _equals(value, want) -> bool:
    return (await value) == want
