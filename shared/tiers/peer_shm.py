"""Peer fetch on the same machine: map the owner's shared-memory segment, else ask over the network.

A worker whose L2 uses `ShmArena` publishes every block as a segment named by
worker and hash; a neighbour maps it copy-on-write (no copy, no socket) and
verifies it like any other tier. When the segment is not there (another host,
evicted, a heap arena) the `fallback` client (NATS, the supported network
path) is asked.
"""

from __future__ import annotations

from shared.tiers.arena import attach_segment
from shared.tiers.block_format import StoredBlock, decode_or_miss
from shared.tiers.miss import Miss, MissCounters, MissReason, Tier


class ShmPeerClient:
    def __init__(self, fingerprint: str, counters: MissCounters, fallback=None) -> None:
        self.fingerprint = fingerprint
        self.counters = counters
        self.fallback = fallback  # a PeerClient, or None: same machine only

    async def fetch(self, worker_id: str, block_hash: bytes) -> StoredBlock | Miss:
        buf = attach_segment(worker_id, block_hash)
        if buf is not None:
            got = decode_or_miss(buf, self.fingerprint, block_hash, Tier.PEER, self.counters)
            if not isinstance(got, Miss) or self.fallback is None:
                return got
        if self.fallback is not None:
            return await self.fallback.fetch(worker_id, block_hash)
        return self.counters.record(Miss(Tier.PEER, MissReason.NOT_FOUND, f"{worker_id}: no segment"))
