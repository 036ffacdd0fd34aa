"""Pin budgets in the real eviction service (ServiceRunner, real nats-server, real S3).

A tenant's pins are counted in bytes against its cap and the deployment's;
a pin past the tenant's cap is refused whole and names the cap; a pool full
for everyone pins the leading run that fits, or nothing for a whole pin; a
release frees the budget; the GC never deletes a chunk whose blocks are
pinned, even past its TTL.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from bus.helpers import FAST_BUS, connected, eventually, unique
from kvmesh.config import (
    EvictionSettings,
    PinQuotaSettings,
    S3Settings,
    ServiceSettings,
    Settings,
    TierSettings,
)
from kvmesh.eviction.client import pin_prefix, unpin_prefix
from kvmesh.eviction.l3_gc import scan
from kvmesh.eviction.setup import setup
from kvmesh.protocol.messages import Role
from kvmesh.service.runner import ServiceRunner
from kvmesh.tiers.block_format import encode_kv_block

from .helpers import chain, kv_chain, l3_store

BLOCK = 100  # bytes per block the service counts (pins.block_bytes)
PINS = PinQuotaSettings(block_bytes=BLOCK, l3_tenant_bytes=5 * BLOCK, l3_pool_bytes=8 * BLOCK)


async def test_caps_refuse_past_the_tenant_and_the_pool_and_gc_keeps_pinned(fresh_nats_server, s3_server,
                                                                            tmp_path) -> None:
    url, fp = fresh_nats_server.url, "fp-pins-01"
    store = l3_store(s3_server, fp, chunk_blocks=2)
    pinned_blocks = kv_chain(2, seed=21)
    short = replace(store, ttl_s=1)  # both chunks expire at once; only the unpinned one may go
    short.put_chain("t-b", [encode_kv_block(kb, fp) for kb in pinned_blocks])
    gone = short.put_chain("t-b", [encode_kv_block(kb, fp) for kb in kv_chain(2, seed=22)])
    settings = Settings(
        nats_url=url, bus=FAST_BUS, state_dir=tmp_path, s3_endpoint=s3_server.endpoint,
        s3_access_key=s3_server.access_key, s3_secret_key=s3_server.secret_key, s3=S3Settings(bucket=store.bucket),
        service=ServiceSettings(worker_id=unique("ev"), http_port=0, heartbeat_interval_s=0.3, heartbeat_ttl_s=2.0),
        eviction=EvictionSettings(tick_s=0.2, gc_interval_s=0.3), pins=PINS,
        tiers=TierSettings(l3_ttl_s=1),  # the TTL the chunks above were written with
    )
    a, b, c = chain(4, "a"), [kb.block_hash for kb in pinned_blocks] + chain(2, "b"), chain(2, "c")
    async with connected(url, "test") as nc:
        runner = ServiceRunner("eviction", Role.EVICTION, setup, settings)
        task = asyncio.create_task(runner.run())
        try:
            await asyncio.wait_for(runner.wait_started(), 15)
            # The endpoint's subscription reaches the server a moment after `started`: a release (which
            # changes no budget) answers once it is there.
            await eventually(lambda: unpin_prefix(nc, chain(1, "probe"), "t-probe"), 10, "the pin endpoint")
            got = await pin_prefix(nc, a, 120, 5, tenant="t-a")
            assert got is not None and (got.pinned, got.refused, got.used_bytes) == (4, None, 4 * BLOCK)
            over = await pin_prefix(nc, chain(2, "a2"), 120, 5, tenant="t-a")
            assert over is not None and (over.pinned, over.refused) == (0, "tenant")
            assert (over.cap_bytes, over.used_bytes, over.wanted_bytes) == (5 * BLOCK, 4 * BLOCK, 2 * BLOCK)
            again = await pin_prefix(nc, a, 600, 5, tenant="t-a")  # a refresh is free
            assert again is not None and (again.pinned, again.refused) == (4, None)

            assert (await pin_prefix(nc, b, 120, 5, tenant="t-b")).pinned == 4  # the pool: 8 of 8 blocks
            whole = await pin_prefix(nc, c, 120, 5, tenant="t-c", whole=True)
            assert whole is not None and (whole.pinned, whole.refused, whole.cap_bytes) == (0, "pool", 8 * BLOCK)
            released = await unpin_prefix(nc, a, "t-a", 5)
            assert released is not None and released.pinned == 4 and released.used_bytes == 0
            assert (await pin_prefix(nc, c, 120, 5, tenant="t-c", whole=True)).pinned == 2

            await eventually(lambda: gone[-1].object_key not in {o.key for o in scan(store)}, 15,
                             "the expired unpinned chunk is deleted")
            left = {o.key for o in scan(store)}
            assert store.key("t-b", pinned_blocks[-1].block_hash) in left  # expired too, but pinned
        finally:
            runner.stop()
            assert await asyncio.wait_for(task, 20) == 0
