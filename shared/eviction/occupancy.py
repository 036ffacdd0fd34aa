"""The eviction service's view of the fleet: which worker holds which block in which tier, and block stats.

Built from KV events (`KVEventBatch`, the stream the cache index reads) and
heartbeats. Per worker it keeps the set of hashes in L1 and in L2; globally
it keeps the hashes known in L3 (content-addressed: one copy serves every
worker) and one `BlockInfo` per hash, the access statistics the policies
rank by: every `BlockStored` of a hash, on any worker or tier, counts as an
access (a block is stored again because a request computed or fetched it).
Each worker's tier capacities come from its heartbeat (`set_capacity`);
`capacity(worker, tier, default)` falls back to the service's settings for
a worker that did not state one.
Not thread-safe: the service's event loop owns it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvmesh.cache_policy.base import BlockInfo
from kvmesh.kv_events.events import (
    BlockMoved,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WorkerCleared,
)
from kvmesh.protocol.blocks import Tier

WORKER_TIERS = (Tier.L1, Tier.L2)


@dataclass(slots=True)
class WorkerOccupancy:
    """One worker's blocks per tier (L1 device pool, L2 host memory), its latest epoch, the advice it has.

    `advised` holds the blocks the eviction service told it to move out of a tier, and when. A mark
    lasts until the worker's events say the block left that tier; a copy stored there again later is a
    new arrival and counts as held. The advisor drops marks the worker never acted on.
    """

    epoch: int = 0
    tiers: dict[Tier, set[bytes]] = field(default_factory=lambda: {t: set() for t in WORKER_TIERS})
    advised: dict[tuple[Tier, bytes], float] = field(default_factory=dict)  # (tier, hash) -> when advised

    def count(self, tier: Tier) -> int:
        return len(self.tiers[tier])

    def clear(self) -> None:
        for held in self.tiers.values():
            held.clear()
        self.advised.clear()


@dataclass(slots=True)
class OccupancyView:
    block_bytes: int = 1  # size of one block, for the policies' value-per-byte
    workers: dict[str, WorkerOccupancy] = field(default_factory=dict)
    l3: set[bytes] = field(default_factory=set)
    stats: dict[bytes, BlockInfo] = field(default_factory=dict)
    capacities: dict[str, dict[Tier, int]] = field(default_factory=dict)  # worker -> its stated tier sizes (blocks)

    def set_capacity(self, worker: str, l1_blocks: int | None, l2_blocks: int | None) -> None:
        """Record what a worker's heartbeat says its tiers hold; None leaves that tier to the default."""
        self.capacities[worker] = {t: n for t, n in ((Tier.L1, l1_blocks), (Tier.L2, l2_blocks)) if n is not None}

    def capacity(self, worker: str, tier: Tier, default: int | None) -> int | None:
        return self.capacities.get(worker, {}).get(tier, default)

    def apply(self, batch: KVEventBatch, now: float) -> None:
        """Apply one batch; a batch of an older epoch than the worker's latest is ignored (a late replay)."""
        occ = self.workers.setdefault(batch.worker, WorkerOccupancy(epoch=batch.epoch))
        if batch.epoch < occ.epoch:
            return
        if batch.epoch > occ.epoch:
            occ.epoch = batch.epoch
            occ.clear()
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(occ, ev, now)
            elif isinstance(ev, BlockRemoved):
                self._discard(occ, ev.tier, ev.hashes)
            elif isinstance(ev, BlockMoved):
                self._discard(occ, ev.src, ev.hashes)
                self._add(occ, ev.dst, [bytes.fromhex(h) for h in ev.hashes])
            elif isinstance(ev, WorkerCleared):
                occ.clear()

    def prune(self, max_stats: int) -> int:
        """Bound the stats: forget the longest-idle blocks held nowhere (no worker tier, not in L3)."""
        excess = len(self.stats) - max_stats
        if excess <= 0:
            return 0
        held = set(self.l3)
        for occ in self.workers.values():
            for blocks in occ.tiers.values():
                held |= blocks
        idle = sorted((i.last_access, h) for h, i in self.stats.items() if h not in held)
        for _, h in idle[:excess]:
            del self.stats[h]
        return min(excess, len(idle))

    def forget_worker(self, worker: str) -> None:
        """A worker went down: its L1/L2 are gone (its L3 chunks stay: they are shared)."""
        self.workers.pop(worker, None)
        self.capacities.pop(worker, None)

    def blocks(self, worker: str, tier: Tier) -> dict[bytes, BlockInfo]:
        """The stats of every block `worker` holds in `tier` (a policy's input)."""
        occ = self.workers.get(worker)
        if occ is None:
            return {}
        return {h: self.info(h) for h in occ.tiers[tier]}

    def info(self, block_hash: bytes) -> BlockInfo:
        got = self.stats.get(block_hash)
        if got is None:  # known from a Moved/Removed only (the view started late): a fresh, cold block
            got = self.stats[block_hash] = BlockInfo(block_hash, None, 0, 1, self.block_bytes, 0.0, 0.0, 0)
        return got

    # --- internals -------------------------------------------------------

    def _stored(self, occ: WorkerOccupancy, ev: BlockStored, now: float) -> None:
        hashes = [bytes.fromhex(h) for h in ev.hashes]
        parent = bytes.fromhex(ev.parent) if ev.parent else None
        for h in hashes:
            info = self.stats.get(h)
            if info is None:
                above = self.stats.get(parent) if parent is not None else None
                depth = above.depth + 1 if above is not None else 0
                self.stats[h] = BlockInfo(h, parent, depth, ev.tokens_per_block, self.block_bytes, now, now)
            else:
                info.last_access = now
                info.access_count += 1
                if info.parent_hash is None and parent is not None:
                    info.parent_hash = parent
            parent = h
        self._add(occ, ev.tier, hashes)

    def _add(self, occ: WorkerOccupancy, tier: Tier, hashes: Iterable[bytes]) -> None:
        if tier is Tier.L3:
            self.l3.update(hashes)
        elif tier in occ.tiers:
            occ.tiers[tier].update(hashes)

    def _discard(self, occ: WorkerOccupancy, tier: Tier, hexes: list[str]) -> None:
        hashes = [bytes.fromhex(h) for h in hexes]
        if tier is Tier.L3:
            self.l3.difference_update(hashes)
        elif tier in occ.tiers:
            occ.tiers[tier].difference_update(hashes)
            for h in hashes:  # advice followed (or the block left anyway): the mark is spent
                occ.advised.pop((tier, h), None)
