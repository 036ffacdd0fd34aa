"""The eviction service counts the blocks it advises out of a tier, by reason, on its registry (real nats-server)."""

from __future__ import annotations

import time

from bus.helpers import FAST_BUS, connected, unique
from kvmesh.bus.publish import Publisher
from kvmesh.eviction.messages import Demote, WorkerCommand
from kvmesh.eviction.service import EvictionService
from kvmesh.protocol import subjects
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.streams import COMMANDS
from kvmesh.sessions.events import SessionEvent, TurnOutcome
from prometheus_client import CollectorRegistry

from .helpers import chain
from .test_service import SETTINGS, next_command, worker_events


def decided(registry: CollectorRegistry, tier: str, reason: str) -> float:
    value = registry.get_sample_value("kvmesh_eviction_decided_blocks_total", {"tier": tier, "reason": reason})
    return value or 0.0


async def test_demotions_are_counted_by_tier_and_reason(fresh_nats_server) -> None:
    url = fresh_nats_server.url
    full, agent = unique("w"), unique("w")
    registry = CollectorRegistry()
    async with connected(url, "eviction") as enc, connected(url, "test") as nc:
        svc = EvictionService(enc, enc.jetstream(), Publisher(enc.jetstream(), FAST_BUS), SETTINGS, 10,
                              registry=registry)
        await svc.start()
        try:
            # Over the high-water mark (10 of 10): down to the low one (5), for reason "watermark".
            async with worker_events(url, full) as pub:
                pub.stored(chain(10, "full"), Tier.L1, tokens_per_block=16)
                await pub.flushed()
                got = await next_command(nc, full)
            assert isinstance(got.command, Demote) and len(got.command.hashes) == 5
            assert decided(registry, "l1", "watermark") == 5

            # A session that ends: its 3 blocks (shared with no other session) leave L1, reason "session_ended".
            blocks = chain(3, "agent")
            async with worker_events(url, agent) as pub:
                pub.stored(blocks, Tier.L1, tokens_per_block=16)
                await pub.flushed()
            now = time.time()
            for outcome in (TurnOutcome.TOOL_CALLS, TurnOutcome.ENDED):
                ev = SessionEvent(tenant="t", tenant_salt="cd" * 16, session_id="s1", request_id=unique("r"),
                                  outcome=outcome, last_hash=blocks[-1].hex(), chain_blocks=3, worker=agent,
                                  started_at=now - 1, at=now)
                await nc.jetstream().publish(subjects.SESSION_EVENTS, ev.to_bytes())
            sub = await nc.jetstream().pull_subscribe(subjects.commands(agent), durable=unique("cmd"),
                                                      stream=COMMANDS.name)
            ended = None
            while ended is None or not isinstance(ended.command, Demote):  # the tool call's Retain comes first
                msg = (await sub.fetch(1, timeout=10))[0]
                await msg.ack()
                ended = WorkerCommand.from_bytes(msg.data)
            assert sorted(ended.command.hashes) == sorted(h.hex() for h in blocks)
            assert decided(registry, "l1", "session_ended") == 3
            assert decided(registry, "l1", "watermark") == 5
        finally:
            await svc.stop()
