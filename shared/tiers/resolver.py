"""Turn a block handle into verified KV, trying the cheapest place first.

Order on any worker: its own L1 (the engine's pool), its own L2, the owning
peer's L2 (when the handle names another worker), then L3 (when the handle
names an object). Every tier that was tried and missed is reported with its
reason; an unresolved handle means "recompute", never an error. This is the
one-handle path; workers restore whole chains in windows
(shared/serving/kv_fetch.py), through the same tiers and `PeerClient`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.engine.kv_block import KVBlock
from kvmesh.protocol.blocks import BlockHandle, Tier
from kvmesh.tiers.block_format import StoredBlock
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.miss import Miss, MissCounters, MissReason


class L1Source(Protocol):
    def get_block(self, block_hash: bytes) -> KVBlock | None: ...


class PeerClient(Protocol):
    async def fetch(self, worker_id: str, block_hash: bytes) -> StoredBlock | Miss: ...

    async def fetch_many(self, worker_id: str, hashes: Sequence[bytes]) -> list[StoredBlock | Miss]:
        """One entry per hash, in order (a batch in few big messages); misses are counted, never raised."""
        ...


class EngineL1:
    """L1 = the engine's prefix cache (a block leaves the pool as a CPU copy)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def get_block(self, block_hash: bytes) -> KVBlock | None:
        blocks = self.engine.export_blocks([block_hash])
        return blocks[0] if blocks else None


@dataclass(slots=True)
class Resolution:
    block: KVBlock | None  # NHD, the engine's dtype; None = recompute
    tier: Tier | None  # where it came from
    misses: list[Miss] = field(default_factory=list)  # tiers tried before, in order


@dataclass
class Resolver:
    worker_id: str
    l1: L1Source | None = None
    l2: HostTier | None = None
    peers: PeerClient | None = None
    l3: L3Store | None = None
    counters: MissCounters = field(default_factory=MissCounters)

    async def resolve(self, handle: BlockHandle) -> Resolution:
        key = handle.hash_bytes
        misses: list[Miss] = []
        if self.l1 is not None:
            block = self.l1.get_block(key)
            if block is not None:
                return Resolution(block, Tier.L1, misses)
            misses.append(self.counters.record(Miss(Tier.L1, MissReason.NOT_FOUND)))
        if self.l2 is not None:
            got = self.l2.get(key)
            if not isinstance(got, Miss):
                return Resolution(got.to_kv_block(), Tier.L2, misses)
            misses.append(got)
        if self.peers is not None and handle.worker_id and handle.worker_id != self.worker_id:
            got = await self.peers.fetch(handle.worker_id, key)
            if not isinstance(got, Miss):
                return Resolution(got.to_kv_block(), Tier.PEER, misses)
            misses.append(got)
        if self.l3 is not None and handle.object_key:
            got = await asyncio.to_thread(self.l3.get_block, handle)
            if not isinstance(got, Miss):
                return Resolution(got.to_kv_block(), Tier.L3, misses)
            misses.append(got)
        return Resolution(None, None, misses)
