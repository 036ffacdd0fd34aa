"""The eviction service in its real shell (ServiceRunner): readiness, the pin endpoint, L3 GC on its timer."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
from bus.helpers import FAST_BUS, connected, eventually, unique
from kvmesh.bus.request import request
from kvmesh.config import (
    EvictionSettings,
    S3Settings,
    ServiceSettings,
    Settings,
    TierSettings,
)
from kvmesh.eviction.l3_gc import scan
from kvmesh.eviction.messages import PinReply, PinRequest
from kvmesh.eviction.setup import setup
from kvmesh.protocol import subjects
from kvmesh.protocol.messages import Role
from kvmesh.service.runner import ServiceRunner
from kvmesh.tiers.block_format import encode_kv_block

from .helpers import chain, kv_chain, l3_store


async def test_service_pins_and_collects_expired_l3_chunks(fresh_nats_server, s3_server, tmp_path) -> None:
    url, fp = fresh_nats_server.url, "fp-runner-01"
    store = l3_store(s3_server, fp, chunk_blocks=2)
    replace(store, ttl_s=1).put_chain("t-x", [encode_kv_block(kb, fp) for kb in kv_chain(2, seed=11)])
    # Written with a longer TTL than the deployment's (as a named cache does): the GC's HEAD finds it.
    kept = store.put_chain("t-x", [encode_kv_block(kb, fp) for kb in kv_chain(2, seed=12)])  # an hour's TTL
    settings = Settings(
        nats_url=url, bus=FAST_BUS, state_dir=tmp_path, s3_endpoint=s3_server.endpoint,
        s3_access_key=s3_server.access_key, s3_secret_key=s3_server.secret_key, s3=S3Settings(bucket=store.bucket),
        service=ServiceSettings(worker_id=unique("ev"), http_port=0, heartbeat_interval_s=0.3, heartbeat_ttl_s=2.0),
        eviction=EvictionSettings(tick_s=0.2, gc_interval_s=0.3), tiers=TierSettings(l3_ttl_s=1),
    )
    async with connected(url, "test") as nc:  # declares the streams, as `kvmesh up` does before services start
        runner = ServiceRunner("eviction", Role.EVICTION, setup, settings)
        task = asyncio.create_task(runner.run())
        try:
            await asyncio.wait_for(runner.wait_started(), 15)
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"{runner.http_endpoint}/readyz")).status_code == 200
            pin = PinRequest(hashes=[h.hex() for h in chain(3, "p")], ttl_s=120)
            assert (await request(nc, subjects.EVICTION_PIN, pin, PinReply, timeout_s=5)).pinned == 3
            await eventually(lambda: [o.key for o in scan(store)] == [kept[-1].object_key], 15,
                             "the expired chunk is deleted and the other kept")

            async def counted() -> bool:
                async with httpx.AsyncClient() as http:
                    text = (await http.get(f"{runner.http_endpoint}/metrics")).text
                deleted = 'kvmesh_eviction_l3_deleted_total{reason="expired"} 1.0' in text
                return deleted and "kvmesh_eviction_pins 3.0" in text
            await eventually(counted, 5, "the deletion and the pins in /metrics")
        finally:
            runner.stop()
            assert await asyncio.wait_for(task, 20) == 0
