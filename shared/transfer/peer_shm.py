"""Peer fetch on the same machine: read the owner's shared-memory slab, else ask over the network.

A worker whose L2 uses `SlabArena` keeps its blocks in one slab that a
neighbour maps once (`SlabReader`); a block is copied out (no socket) and
verified like any other tier. Blocks not found there (another host, evicted,
a heap arena) or that fail verification are asked of the `fallback` client
(NATS, the supported network path) in one batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.block_format import StoredBlock, decode_or_miss
from kvmesh.tiers.miss import Miss, MissCounters, MissReason
from kvmesh.tiers.shm_slab import SlabReader


class ShmPeerClient:
    def __init__(self, fingerprint: str, counters: MissCounters, fallback=None,
                 slabs: SlabReader | None = None) -> None:
        self.fingerprint = fingerprint
        self.counters = counters
        self.fallback = fallback  # a PeerTransport (shared/transfer/peer_transport.py), or None: same machine only
        self.slabs = slabs if slabs is not None else SlabReader()  # shared between a worker's clients

    async def fetch(self, worker_id: str, block_hash: bytes) -> StoredBlock | Miss:
        return (await self.fetch_many(worker_id, [block_hash]))[0]

    async def fetch_many(self, worker_id: str, hashes: Sequence[bytes]) -> list[StoredBlock | Miss]:
        """One entry per hash, in order: same-host segments first, the network client for the rest."""
        out: list[StoredBlock | Miss] = []
        rest: list[int] = []
        for i, h in enumerate(hashes):
            buf = self.slabs.read(worker_id, h)
            got = None if buf is None else decode_or_miss(buf, self.fingerprint, h, Tier.PEER, self.counters)
            if got is None or (isinstance(got, Miss) and self.fallback is not None):
                rest.append(i)
                got = Miss(Tier.PEER, MissReason.NOT_FOUND, f"{worker_id}: not in its slab")
            out.append(got)
        if not rest:
            return out
        if self.fallback is None:
            for i in rest:
                self.counters.record(out[i])
            return out
        fetched = await self.fallback.fetch_many(worker_id, [hashes[i] for i in rest])
        for i, got in zip(rest, fetched):
            out[i] = got
        return out
