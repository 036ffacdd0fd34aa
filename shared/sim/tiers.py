"""Two cache tiers for the replay: L1 (the device pool) over L2 (host memory), exclusive.

Both are ``PolicyCache``s run by the same policy object, as the eviction
service runs one policy over a worker's L1 and L2 (``QueueCache``s, each
with its own queues, for a queue-structured reference such as S3-FIFO).
What L1 evicts is demoted to L2 (``adopt``: it stays out if it ranks
below everything L2 could evict); what L2 evicts is dropped. A request's
prefix hit is its leading blocks found in L1, then, continuing the chain,
in L2; its chain is then inserted into L1, and its blocks that made it
there leave L2 (promoted, or recomputed: a block lives in one tier at a
time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.cache_policy.base import EvictionPolicy
from kvmesh.cache_policy.policy_cache import BlockSpec, PolicyCache
from kvmesh.cache_policy.queue_cache import QueueCache, QueuePolicy


@dataclass(slots=True, frozen=True)
class TierHits:
    l1: int  # leading blocks found in L1
    l2: int  # the blocks after those, found in L2


def tier_cache(policy: EvictionPolicy | QueuePolicy, capacity: int) -> PolicyCache | QueueCache:
    """The cache that runs ``policy``: a queue-structured one brings its own queues, any other is a priority."""
    if isinstance(policy, QueuePolicy):
        return QueueCache(policy, capacity)
    return PolicyCache(policy, capacity)


class TieredCache:
    def __init__(self, policy: EvictionPolicy | QueuePolicy, l1_capacity: int, l2_capacity: int = 0) -> None:
        if l2_capacity < 0:
            raise ValueError(f"l2 capacity must be >= 0, got {l2_capacity}")
        self.l1 = tier_cache(policy, l1_capacity)
        self.l2 = tier_cache(policy, l2_capacity) if l2_capacity else None

    def lookup(self, hashes: Sequence[bytes]) -> TierHits:
        n1 = self.l1.match_prefix(hashes)
        n2 = self.l2.match_prefix(hashes[n1:]) if self.l2 is not None else 0
        return TierHits(n1, n2)

    def request(self, specs: Sequence[BlockSpec], now: float) -> TierHits:
        """Count the request's prefix hit per tier, then cache its chain in L1 and demote what L1 evicts."""
        hashes = [s.block_hash for s in specs]
        hits = self.lookup(hashes)
        result = self.l1.insert(specs, now)
        if self.l2 is not None:
            for h in hashes[hits.l1:]:
                if h in self.l1:  # promoted, or recomputed past a gap: L1 holds it now
                    self.l2.remove(h, now)
                else:  # L1 did not take it: it was still read here, which its rank must know
                    self.l2.touch(h, now)
            for info in result.evicted_blocks:
                self.l2.adopt(info, now)
        return hits

    def rekey(self, hashes: set[bytes], now: float) -> None:
        if not hashes:
            return
        self.l1.rekey(hashes, now)
        if self.l2 is not None:
            self.l2.rekey(hashes, now)
