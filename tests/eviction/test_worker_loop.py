"""Advice obeyed end to end: a real worker (Engine on its EngineLoop, HostTier, KV events, a ConsumerLoop on
its COMMANDS subject) fills its L1 past the high-water mark; the service's demote reaches it over NATS; the
blocks move to L2; the worker's own events tell the service, which then stops advising."""

from __future__ import annotations

import asyncio

from bus.helpers import FAST_BUS, connected, eventually, unique
from kvmesh.bus.consumer import ConsumerLoop
from kvmesh.bus.publish import Publisher
from kvmesh.cache_policy.registry import get_policy
from kvmesh.config import EngineSettings, IndexSettings
from kvmesh.engine.engine import Engine
from kvmesh.kv_events.publisher import KVEventPublisher
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol.blocks import Tier
from kvmesh.serving.engine_loop import EngineLoop
from kvmesh.serving.worker_commands import CommandHandler, command_consumer
from kvmesh.tiers.l2_host import HostTier

from .helpers import BS, PARAMS, PROMPT, chain
from .test_service import service, worker_events


async def test_demote_advice_moves_a_real_workers_blocks(fresh_nats_server, tiny_loaded) -> None:
    url, worker, later = fresh_nats_server.url, unique("w"), unique("w")
    async with connected(url, worker) as nc:
        js, metrics = nc.jetstream(), ServiceMetrics.create("test")
        pub = Publisher(js, FAST_BUS, metrics)
        events = KVEventPublisher(pub, worker, IndexSettings(flush_interval_s=0.01))
        await events.start(nc)
        engine = Engine(tiny_loaded, EngineSettings(block_size=BS, num_blocks=64), listener=events)
        loop = EngineLoop(engine)
        loop.start()
        l2 = HostTier(1 << 26, get_policy("lru"), tiny_loaded.fingerprint, worker)
        handler = CommandHandler(loop, l2, None, events)
        consumer = ConsumerLoop(js, command_consumer(worker), handler.on_message, pub, metrics, FAST_BUS, 2.0)
        task = asyncio.create_task(consumer.run())
        try:
            await consumer.wait_ready()
            async with service(url, l1_capacity=4) as svc:  # 4 blocks > 0.9 x 4: demote down to 2
                first = await loop.call(lambda e: e.generate([PROMPT], PARAMS)[0])
                await eventually(lambda: handler.applied.moved == 2, 15, "the worker applied the advice")
                hashes = engine.block_hashes(PROMPT)
                assert await loop.call(lambda e: e.cached_prefix_tokens(PROMPT)) == 2 * BS
                assert [h in l2 for h in hashes] == [False, False, True, True]  # the tail left, leaf-first

                def settled() -> bool:
                    occ = svc.view.workers.get(worker)
                    return occ is not None and occ.count(Tier.L1) == 2 and occ.count(Tier.L2) == 2
                await eventually(settled, 10, "the worker's events reached the service")
                # Below high water now: no more advice. Shown by a later worker over high water: the tick
                # that advises it goes over every worker in the order the service first saw them, this one
                # first, so any further advice of this one would already be in `sent`.
                async with worker_events(url, later) as other:
                    other.stored(chain(4, "later"), Tier.L1, tokens_per_block=BS)
                    await other.flushed()
                    await eventually(lambda: any(c.worker == later for c in svc.sent), 10,
                                     "advice to the later over-full worker")
                assert handler.applied.moved == 2 and [c.worker for c in svc.sent if c.worker != later] == [worker]
            again = await loop.call(lambda e: e.generate([PROMPT], PARAMS)[0])
            assert again.token_ids == first.token_ids and again.cached_tokens == 2 * BS
        finally:
            consumer.stop()
            await task
            loop.stop()
            await events.stop()
            l2.close()
