"""The worker side of eviction advice: apply a `WorkerCommand` through the engine and tier APIs.

- demote L1 -> L2: export the blocks from the engine, put them into L2,
  then drop them from L1 (only unreferenced leaves drop: a block a request
  or a pin holds stays; the engine's listener reports the L1 removal);
- demote L2 -> L3: drop the L2 copy (the service sends this only for blocks
  L3 holds: uploads already wrote them); pinned L2 blocks stay;
- drop: forget the blocks in L1 or L2;
- warm: fetch chunk objects of this worker's model from L3 into L2 (verified on read);
- retain: pin an agent session's chain in L1 until its predicted return,
  first bringing back from L2/L3 what left L1 when asked to (a prefetch,
  shared/serving/prefetch.py).

Every action is idempotent (a block no longer where the command says is
skipped), so a redelivered command is harmless. The engine runs on its own
thread; everything here runs on the worker's event loop. Wiring in a worker
service: ``ctx.add_consumer(command_consumer(ctx.worker_id), handler.on_message)``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from kvmesh.engine.engine import Engine
from kvmesh.eviction.messages import Demote, Drop, Retain, Warm, WorkerCommand
from kvmesh.kv_events.publisher import KVEventPublisher
from kvmesh.protocol import subjects
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.streams import COMMANDS, ConsumerSpec, worker_consumer
from kvmesh.serving.kv_fetch import DEFAULT_WINDOW_BLOCKS, L2Source, L3Source, PeerSource, Source
from kvmesh.serving.prefetch import retain_chain
from kvmesh.serving.worker_tiers import namespace_for
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.miss import Miss
from kvmesh.tiers.resolver import PeerClient
from nats.aio.msg import Msg

T = TypeVar("T")


def command_consumer(worker_id: str) -> ConsumerSpec:
    """The worker's durable consumer of its own commands (stream COMMANDS)."""
    return worker_consumer(COMMANDS, "cmd", worker_id, subjects.commands(worker_id))


class EngineCaller(Protocol):
    """What the handler needs of `kvmesh.serving.engine_loop.EngineLoop`: run a function on the engine thread."""

    async def call(self, fn: Callable[[Engine], T]) -> T: ...

    def release_lease(self, lease: str) -> None: ...


@dataclass(slots=True)
class CommandResult:
    moved: int = 0  # blocks now one tier down
    dropped: int = 0
    warmed: int = 0  # blocks fetched from L3 into L2
    retained: int = 0  # blocks pinned in L1 for a session expected back
    prefetched: int = 0  # of those, blocks brought back into L1 first
    skipped: int = 0  # in use, pinned, absent, or a chunk L3 could not serve


@dataclass
class CommandHandler:
    engine: EngineCaller
    l2: HostTier
    l3: L3Store | None = None
    events: KVEventPublisher | None = None
    resolve_inflight: int = 3  # a prefetch's windows in flight (as a request's restore)
    peers: PeerClient | None = None  # other workers' L2 (a retain naming an `owner`)
    applied: CommandResult = field(default_factory=CommandResult)  # running totals, for metrics and tests

    async def on_message(self, msg: Msg) -> None:
        """A `ConsumerLoop` handler: undecodable bytes are permanent (dead-lettered), the rest is applied."""
        await self.apply(WorkerCommand.from_bytes(msg.data))

    async def apply(self, msg: WorkerCommand) -> CommandResult:
        cmd = msg.command
        if isinstance(cmd, Demote):
            res = await self.demote([bytes.fromhex(h) for h in cmd.hashes], cmd.src)
        elif isinstance(cmd, Drop):
            res = await self.drop([bytes.fromhex(h) for h in cmd.hashes], cmd.tier)
        elif isinstance(cmd, Retain):
            res = await self.retain(cmd)
        else:
            assert isinstance(cmd, Warm)
            res = await self.warm(cmd.keys)
        for name in ("moved", "dropped", "warmed", "retained", "prefetched", "skipped"):
            setattr(self.applied, name, getattr(self.applied, name) + getattr(res, name))
        return res

    async def demote(self, hashes: list[bytes], src: Tier) -> CommandResult:
        if src is Tier.L1:
            return await self._l1_to_l2(hashes)
        if src is Tier.L2:
            return self._drop_l2(hashes, moved=True)
        return CommandResult(skipped=len(hashes))

    async def drop(self, hashes: list[bytes], tier: Tier) -> CommandResult:
        if tier is Tier.L1:
            dropped = await self.engine.call(lambda e: e.drop_blocks(hashes))
            return CommandResult(dropped=len(dropped), skipped=len(hashes) - len(dropped))
        if tier is Tier.L2:
            return self._drop_l2(hashes, moved=False)
        return CommandResult(skipped=len(hashes))

    async def warm(self, keys: list[str]) -> CommandResult:
        res = CommandResult()
        if self.l3 is None:
            res.skipped = len(keys)
            return res
        mine = f"{self.l3.fingerprint}/"
        for key in keys:
            if not key.startswith(mine):  # another model's chunk (the service ranks every model's)
                res.skipped += 1
                continue
            chunk = await asyncio.to_thread(self.l3.get_chunk, key)
            if isinstance(chunk, Miss):
                res.skipped += 1
                continue
            for stored in chunk:
                kb = stored.to_kv_block()
                if kb.block_hash in self.l2:
                    res.skipped += 1  # already here: nothing to fetch, nothing to announce
                    continue
                put = self.l2.put_block(kb)
                if self.events is not None:
                    if put.evicted:
                        self.events.removed(put.evicted, Tier.L2)
                    if put.stored:
                        self.events.stored([kb.block_hash], Tier.L2, parent=kb.parent_hash,
                                           tokens_per_block=len(kb.token_ids))
                res.warmed += int(put.stored)
                res.skipped += int(not put.stored)
        return res

    async def retain(self, cmd: Retain) -> CommandResult:
        hashes = [bytes.fromhex(h) for h in cmd.hashes]
        sources: list[Source] = []
        if cmd.fetch:
            sources.append(L2Source(self.l2))
            if cmd.owner and self.peers is not None:
                sources.append(PeerSource(self.peers, lambda _: (cmd.owner,)))
            if self.l3 is not None:
                sources.append(L3Source(self.l3, namespace_for(cmd.tenant_salt), search_partial=True))
        window = self.l3.chunk_blocks if self.l3 is not None else DEFAULT_WINDOW_BLOCKS
        got = await retain_chain(self.engine, hashes, cmd.until, sources, tenant_salt=bytes.fromhex(cmd.tenant_salt),
                                 window_blocks=window, inflight=self.resolve_inflight)
        return CommandResult(retained=got.pinned, prefetched=got.fetched, skipped=len(hashes) - got.pinned)

    # --- internals ---------------------------------------------------------

    async def _l1_to_l2(self, hashes: list[bytes]) -> CommandResult:
        # Copy out, store in L2 here (L2 belongs to the event loop), then drop: a block a request
        # took in between is not dropped (the engine drops only unreferenced leaves) and the copy is harmless.
        blocks = await self.engine.call(lambda e: [kb for h in hashes for kb in e.export_blocks([h])])
        safe: list[bytes] = []
        for kb in blocks:
            put = self.l2.put_block(kb)
            if put.stored:
                safe.append(kb.block_hash)
                self._announce_l2(kb, put.evicted)
        dropped = await self.engine.call(lambda e: e.drop_blocks(safe)) if safe else []
        return CommandResult(moved=len(dropped), skipped=len(hashes) - len(dropped))

    def _drop_l2(self, hashes: list[bytes], moved: bool) -> CommandResult:
        now = self.l2.clock()
        gone = [h for h in hashes if not self.l2.is_pinned(h, now) and self.l2.remove(h)]
        if gone and self.events is not None:
            self.events.removed(gone, Tier.L2)
        n = len(gone)
        return CommandResult(moved=n if moved else 0, dropped=0 if moved else n, skipped=len(hashes) - n)

    def _announce_l2(self, kb, evicted: list[bytes]) -> None:
        if self.events is None:
            return
        if evicted:
            self.events.removed(evicted, Tier.L2)
        self.events.stored([kb.block_hash], Tier.L2, parent=kb.parent_hash, tokens_per_block=len(kb.token_ids))
