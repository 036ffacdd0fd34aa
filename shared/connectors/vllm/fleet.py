"""The vLLM worker as a member of a kvmesh fleet: its heartbeat, its KV events and its commands, over NATS.

With `KVMESH_NATS_URL` set, the connector's worker joins the fleet the way a
kvmesh worker does: a heartbeat in the `workers` bucket (role `vllm`: the
ingress never sends it kvmesh jobs) and KV events on KV_EVENTS for what its
L2 stores and evicts and what its uploads put in L3. The cache index then
answers lookups with the vLLM worker's blocks, and purges them when its
heartbeat lapses, as for any worker. vLLM's own pool (L1) is vLLM's and is
not reported. The vLLM engine of a kvmesh worker (fleet role `prefill` or
`decode`) also takes that worker's eviction commands (advice.py).

Everything here runs on the connector's own event loop thread
(store.py); the worker thread hands it events through `post`. With NATS
users, the connector connects as the `vllm` user (`KVMESH_NATS_USER=vllm`
and its `KVMESH_NATS_PASSWORD`; shared/bus/permissions.py): its own KV
events and heartbeat, and the index's dumps of them, nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.bus.client_auth import ClientAuth
from kvmesh.bus.connection import close, connect
from kvmesh.bus.consumer import ConsumerLoop, Handler
from kvmesh.bus.permissions import VLLM, inbox_prefix
from kvmesh.bus.publish import Publisher
from kvmesh.config import BusSettings, Settings
from kvmesh.kv_events.publisher import KVEventPublisher
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.messages import Role
from kvmesh.service.heartbeat import HeartbeatLoop
from kvmesh.serving.worker_commands import command_consumer
from nats.aio.client import Client as NATS


@dataclass
class FleetLink:
    nc: NATS
    events: KVEventPublisher
    heartbeat: HeartbeatLoop | None  # None: the kvmesh worker it serves in heartbeats
    _beating: asyncio.Task[None] | None
    worker_id: str = ""
    bus: BusSettings = field(default_factory=BusSettings)
    _commands: ConsumerLoop | None = None
    _obeying: asyncio.Task[None] | None = None

    @classmethod
    async def join(cls, settings: Settings, worker_id: str, load: Callable[[], float], role: str = VLLM) -> FleetLink:
        """`role`: `vllm` for a vLLM server of its own; a kvmesh worker role (`prefill`) for the vLLM engine
        inside that kvmesh worker (shared/workers/vllm_backend.py), which heartbeats under the same id."""
        auth = ClientAuth.from_settings(settings, inbox_prefix(role, worker_id))
        nc = await connect(settings.nats_url or "", f"vllm-connector:{worker_id}", settings.bus, auth)
        js = nc.jetstream()
        metrics = ServiceMetrics.create("vllm-connector")
        events = KVEventPublisher(Publisher(js, settings.bus, metrics), worker_id, settings.index)
        await events.start(nc)
        if role != VLLM:
            return cls(nc, events, None, None, worker_id, settings.bus)
        s = settings.service
        heartbeat = HeartbeatLoop(js, worker_id, Role.VLLM, "", s.heartbeat_interval_s, s.heartbeat_ttl_s, metrics,
                                  load=load, kv_position=events.position)
        return cls(nc, events, heartbeat, asyncio.create_task(heartbeat.run()), worker_id, settings.bus)

    def obey(self, handler: Handler) -> None:
        """Take this worker's eviction commands (its durable consumer on COMMANDS) with `handler`: only for the
        vLLM engine of a kvmesh worker, whose NATS user may read them (a `vllm` user may not)."""
        publisher, metrics = self.events.publisher, self.events.publisher.metrics
        self._commands = ConsumerLoop(self.nc.jetstream(), command_consumer(self.worker_id), handler, publisher,
                                      metrics, self.bus)
        self._obeying = asyncio.create_task(self._commands.run())

    def l2_changed(self, stored: list[tuple[bytes, bytes | None]], evicted: list[bytes], tokens_per_block: int) -> None:
        """`stored`: (hash, parent) of each block L2 took, in chain order."""
        if evicted:
            self.events.removed(evicted, Tier.L2)
        for block_hash, parent in stored:
            self.events.stored([block_hash], Tier.L2, parent=parent, tokens_per_block=tokens_per_block)

    def l3_stored(self, hashes: list[bytes], tokens_per_block: int) -> None:
        self.events.stored(hashes, Tier.L3, tokens_per_block=tokens_per_block)

    async def leave(self) -> None:
        """Stop taking commands, publish what is pending, withdraw the heartbeat (the index drops this worker's
        L2 at once)."""
        if self._commands is not None and self._obeying is not None:
            self._commands.stop()
            await asyncio.gather(self._obeying, return_exceptions=True)
        await self.events.stop()
        try:
            if self.heartbeat is not None:
                await self.heartbeat.withdraw()
        finally:
            if self._beating is not None:
                self._beating.cancel()
                await asyncio.gather(self._beating, return_exceptions=True)
            await close(self.nc)
