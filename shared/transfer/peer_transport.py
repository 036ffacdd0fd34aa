"""The one interface a worker-to-worker KV data path implements.

A transport fetches blocks from another worker's L2 by hash. `fetch_many`
returns one entry per hash, in the order asked: a verified `StoredBlock`, or
a counted `Miss` saying why not (not there, peer gone, stalled, corrupt).
It never raises for a peer's failure and never waits without a bound: a
miss means "recompute or try the next tier". Implementations: NATS
(`shared/transfer/peer_nats.py`, always available), same-host shared memory in
front of it (`shared/transfer/peer_shm.py`); see docs/transfer-engines.md for
the engines measured and why NATS is the supported network path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvmesh.tiers.block_format import StoredBlock
from kvmesh.tiers.miss import Miss


@runtime_checkable
class PeerTransport(Protocol):
    async def fetch_many(self, worker_id: str, hashes: Sequence[bytes]) -> list[StoredBlock | Miss]: ...

    async def fetch(self, worker_id: str, block_hash: bytes) -> StoredBlock | Miss: ...
