"""One emulated worker of `kvmesh bench fleet`: the real control-plane parts of a worker, no engine.

What a prefill worker puts on NATS is all here, through the code the
worker runs: its heartbeat (`HeartbeatLoop` into the `workers` bucket,
with its KV-event position and the L1 size the eviction service advises
by), its KV events (`KVEventPublisher`: batches on KV_EVENTS, the
state-dump responder) and its eviction commands (the durable
`command_consumer` in a `ConsumerLoop`). Its L1 is an LRU of block hashes of
a fixed capacity: a chain the router assigns is stored (new blocks only),
the least recently used blocks leave when it is full, and a `Demote` moves
the advised blocks to L2, as a real worker's pool would report them.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvmesh.bus.consumer import ConsumerLoop
from kvmesh.bus.publish import Publisher
from kvmesh.config import BusSettings, IndexSettings
from kvmesh.eviction.messages import Demote, WorkerCommand
from kvmesh.kv_events.publisher import KVEventPublisher
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.messages import Role
from kvmesh.service.heartbeat import HeartbeatLoop
from kvmesh.serving.worker_commands import command_consumer
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext


@dataclass(frozen=True, slots=True)
class FleetWorkerConfig:
    l1_blocks: int  # the emulated pool's capacity (the eviction service is told the same)
    block_tokens: int = 512  # Mooncake's blocks
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    worker_fetch_timeout_s: float = BusSettings().worker_fetch_timeout_s  # an idle command consumer polls this often


@dataclass(slots=True)
class EmulatedWorker:
    worker_id: str
    nc: NATS
    js: JetStreamContext
    publisher: Publisher
    metrics: ServiceMetrics
    cfg: FleetWorkerConfig
    events: KVEventPublisher = field(init=False)
    heartbeat: HeartbeatLoop = field(init=False)
    commands: ConsumerLoop = field(init=False)
    l1: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    advised: asyncio.Event = field(default_factory=asyncio.Event)  # set by each Demote that arrives
    advised_at: float = 0.0  # perf_counter of the latest Demote's arrival
    consumer_error: str | None = None  # why its command consumer could not be created (the server refused)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.events = KVEventPublisher(self.publisher, self.worker_id, IndexSettings())
        self.heartbeat = HeartbeatLoop(self.js, self.worker_id, Role.PREFILL, "http://127.0.0.1:9",
                                       self.cfg.heartbeat_interval_s, self.cfg.heartbeat_ttl_s, self.metrics,
                                       capacity=4.0, kv_position=self.events.position,
                                       l1_capacity_blocks=self.cfg.l1_blocks)
        self.commands = ConsumerLoop(self.js, command_consumer(self.worker_id), self._on_command, self.publisher,
                                     self.metrics, BusSettings(worker_fetch_timeout_s=self.cfg.worker_fetch_timeout_s))

    async def start(self) -> None:
        """Begin the KV-event epoch, then beat (the first beat at once) and consume, in tasks."""
        await self.events.start(self.nc)
        consume = asyncio.create_task(self.commands.run())
        self._tasks = [asyncio.create_task(self.heartbeat.run()), consume]
        ready = asyncio.create_task(self.commands.wait_ready())
        await asyncio.wait({consume, ready}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():  # run() ended first: the server refused the consumer (e.g. a consumer limit)
            ready.cancel()
            exc = consume.exception()
            self.consumer_error = repr(exc) if exc is not None else "consumer loop ended"

    async def stop(self, withdraw: bool = True) -> None:
        self.commands.stop()
        if withdraw:
            await self.heartbeat.withdraw()
        else:
            self.heartbeat.stop()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.events.stop()

    def store(self, chain: list[bytes]) -> int:
        """A request ran here: its chain is in L1 (new blocks stored, LRU blocks out). Returns events recorded."""
        new = []
        for h in chain:
            if h in self.l1:
                self.l1.move_to_end(h)
            else:
                self.l1[h] = None
                new.append(h)
        events = 0
        if new:
            self.events.stored(new, Tier.L1, tokens_per_block=self.cfg.block_tokens)
            events += 1
        over = len(self.l1) - self.cfg.l1_blocks
        if over > 0:
            gone = [self.l1.popitem(last=False)[0] for _ in range(over)]
            self.events.removed(gone, Tier.L1)
            events += 1
        return events

    async def _on_command(self, msg: Msg) -> None:
        cmd = WorkerCommand.from_bytes(msg.data).command
        if isinstance(cmd, Demote) and cmd.src is Tier.L1:
            hashes = [h for h in map(bytes.fromhex, cmd.hashes) if h in self.l1]
            for h in hashes:
                del self.l1[h]
            if hashes:
                self.events.moved(hashes, Tier.L1, Tier.L2)
            self.advised_at = time.perf_counter()
            self.advised.set()
