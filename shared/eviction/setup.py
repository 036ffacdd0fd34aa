"""Wiring the eviction service into the runner: its endpoint, its L3 store, live Belady, start and stop."""

from __future__ import annotations

from kvmesh.eviction.live_belady import LiveBelady
from kvmesh.eviction.messages import PinRequest
from kvmesh.eviction.pins import PinTable, kv_block_bytes
from kvmesh.eviction.service import EvictionService
from kvmesh.kv_events.publisher import KVEventPublisher
from kvmesh.protocol import subjects
from kvmesh.service.runner import ServiceContext
from kvmesh.tiers.factory import build_l3_store
from kvmesh.tiers.miss import MissCounters


async def setup(ctx: ServiceContext) -> None:
    s = ctx.settings
    # No fingerprint: the service garbage-collects every model's chunks in the bucket.
    l3 = build_l3_store(s, "", s.engine.block_size, MissCounters())
    events = KVEventPublisher(ctx.publisher, ctx.worker_id, s.index)  # L3 deletions -> the cache index
    await events.start(ctx.nc)
    ctx.kv_position = events.position
    block_bytes = 1  # without a model dir, a pin that does not say its size counts one byte a block
    if s.model_dir is not None and (s.model_dir / "config.json").is_file():
        block_bytes = kv_block_bytes(s.model_dir, s.engine.dtype, s.engine.block_size)
    service = EvictionService(ctx.nc, ctx.js, ctx.publisher, s.eviction,
                              s.eviction.l1_capacity_blocks or s.engine.num_blocks, l3, ctx.metrics.registry,
                              events, PinTable.with_caps(s.eviction, s.pins, block_bytes))
    await service.start()
    if s.eviction.live_belady.enabled:  # the gap to the offline optimum on the served traffic
        live = LiveBelady(ctx.js, s.eviction.live_belady, s.eviction.l1_capacity_blocks or s.engine.num_blocks,
                          ctx.metrics.registry)
        await live.start()
        ctx.on_stop.append(live.stop)
    ctx.add_endpoint(subjects.EVICTION_PIN, PinRequest, service.pin)
    ctx.on_stop.append(service.stop)
    ctx.on_stop.append(events.stop)
