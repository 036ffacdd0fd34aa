"""Where a KV block lives: the tier names and the block handle services pass each other.

Prefill hands decode a list of handles over NATS; the cache index stores them.
A handle is small (no tensor bytes) and self-verifying: `checksum` is the
xxh3-128 stored at the end of the encoded block, so a resolver can reject a
stale copy even if it decodes cleanly.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict


class Tier(str, Enum):
    L1 = "L1"  # the worker's device pool (the engine's prefix cache)
    L2 = "L2"  # host memory of a worker
    PEER = "PEER"  # another worker's L2, fetched over the network
    L3 = "L3"  # object storage


class BlockHandle(BaseModel):
    model_config = ConfigDict(frozen=True)

    schema_version: int = 1
    block_hash: str  # hex of the 32-byte chained hash
    tier: Tier  # where the producer put it
    worker_id: str = ""  # owner of the L1/L2 copy ("" = none)
    object_key: str = ""  # L3 object holding it ("" = not in L3)
    offset: int = 0  # byte offset of the block inside object_key (grouped chunk)
    size: int  # encoded size in bytes
    checksum: str  # hex xxh3-128 of the encoded block (its trailer)

    @property
    def hash_bytes(self) -> bytes:
        return bytes.fromhex(self.block_hash)
