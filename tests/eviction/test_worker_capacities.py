"""Each worker is advised at the capacities its heartbeat states (real nats-server, real eviction service).

Three workers beat through `HeartbeatLoop`: a small pool (10 blocks), a
large one (40) and one that states nothing (the service's setting, 100,
applies). Each fills its L1 past the high watermark (0.9) of its own pool
and no other: at one shared capacity at most one of them would be advised,
and by a different count. Each demotion must bring its worker to the low
watermark (0.5) of its own pool.
"""

from __future__ import annotations

import asyncio

from bus.helpers import connected, eventually, unique
from kvmesh.eviction.messages import Demote
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.messages import Heartbeat, Role
from kvmesh.service.heartbeat import HeartbeatLoop

from .helpers import chain
from .test_service import next_command, service, worker_events


def _beat(js, worker: str, l1: int | None) -> HeartbeatLoop:
    return HeartbeatLoop(js, worker, Role.DECODE, "http://127.0.0.1:1", interval_s=0.3, ttl_s=5.0,
                         metrics=ServiceMetrics.create("test"), l1_capacity_blocks=l1,
                         l2_capacity_blocks=None if l1 is None else 4 * l1)


async def test_two_pool_sizes_get_watermark_advice_at_their_own_capacity(fresh_nats_server) -> None:
    url = fresh_nats_server.url
    small, large, silent = unique("small"), unique("large"), unique("silent")
    held = {small: chain(10, "s"), large: chain(38, "l"), silent: chain(95, "q")}  # 100%, 95%, 95% full
    async with service(url, l1_capacity=100) as svc, connected(url, "test") as nc:
        beats = [_beat(nc.jetstream(), small, 10), _beat(nc.jetstream(), large, 40), _beat(nc.jetstream(), silent, None)]
        tasks = [asyncio.create_task(b.run()) for b in beats]
        try:
            await eventually(lambda: {small, large, silent} <= set(svc.view.capacities), 10,
                             "the service read the three heartbeats")
            assert svc.view.capacity(small, Tier.L1, 100) == 10 and svc.view.capacity(large, Tier.L2, None) == 160
            assert svc.view.capacity(silent, Tier.L1, 100) == 100
            for worker, hashes in held.items():
                async with worker_events(url, worker) as pub:
                    pub.stored(hashes, Tier.L1, tokens_per_block=16)
                    await pub.flushed()
            got = {w: await next_command(nc, w) for w in held}
        finally:
            for b in beats:
                b.stop()
            await asyncio.gather(*tasks)
    for worker, capacity in ((small, 10), (large, 40), (silent, 100)):
        cmd = got[worker].command
        assert isinstance(cmd, Demote) and cmd.src is Tier.L1
        # Down to the low watermark of its own pool: 5 of 10, 20 of 40, 50 of 100.
        assert len(held[worker]) - len(cmd.hashes) == capacity // 2
        assert set(bytes.fromhex(h) for h in cmd.hashes) <= set(held[worker])


def test_a_heartbeat_without_capacities_still_parses() -> None:
    hb = ('{"schema_version":1,"worker_id":"w","role":"decode","load":0.0,"capacity":1.0,'
          '"started_at":"2026-01-01T00:00:00Z","http_endpoint":"http://x:1","seq":1,"ttl_s":5.0}')
    got = Heartbeat.from_bytes(hb.encode())
    assert got.l1_capacity_blocks is None and got.l2_capacity_blocks is None
