"""L2: a bounded host-memory store of encoded blocks, one per worker.

Blocks are kept encoded (the block format), so serving a peer or writing L3
needs no re-encode, and every read is verified. Capacity is in bytes; when a
put does not fit, the blocks with the lowest policy priority among the
unpinned ones are evicted (any `EvictionPolicy`, see shared/cache_policy).
Unlike `PolicyCache` (whole chains, capacity in blocks, leaf-first), L2
takes single blocks whose parents may live in L1, so it counts bytes and
evicts any unpinned block.
Not thread-safe: one owner (the worker's event loop) calls it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.cache_policy.base import AccessObserver, BlockInfo, EvictionPolicy
from kvmesh.engine.kv_block import KVBlock
from kvmesh.protocol.blocks import BlockHandle, Tier
from kvmesh.tiers.arena import Arena, HeapArena
from kvmesh.tiers.block_format import (
    BlockHeader,
    StoredBlock,
    checksum_of,
    decode_header,
    decode_or_miss,
    encode_block_into,
    encoded_size,
    header_for,
)
from kvmesh.tiers.miss import Miss, MissCounters, MissReason


@dataclass(slots=True)
class PutResult:
    stored: bool
    evicted: list[bytes]
    handle: BlockHandle | None = None


class HostTier:
    def __init__(self, capacity_bytes: int, policy: EvictionPolicy, fingerprint: str, worker_id: str = "",
                 arena: Arena | None = None, counters: MissCounters | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.fingerprint = fingerprint
        self.worker_id = worker_id
        self.arena = arena if arena is not None else HeapArena()
        self.counters = counters if counters is not None else MissCounters()
        self.clock = clock
        self.used_bytes = 0
        self.evicted_blocks = 0  # blocks let go to make room (for metrics)
        self.refused_blocks = 0  # blocks not stored: too big, not admitted, or no room (all pinned)
        self._info: dict[bytes, BlockInfo] = {}
        self._checksums: dict[bytes, bytes] = {}
        # Policies that keep history across evictions (TinyLFU ...) hear of every put and hit.
        self._observe = policy.on_access if isinstance(policy, AccessObserver) else None

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._info

    def __len__(self) -> int:
        return len(self._info)

    def put_block(self, block: KVBlock) -> PutResult:
        """Encode an engine block straight into the arena (one copy of its payload; no re-verification:
        the checksum was just computed from the bytes written)."""
        header = header_for(block, self.fingerprint)
        total = encoded_size(header)

        def write(key: bytes) -> bytes | None:
            digest: list[bytes] = []
            ok = self.arena.write_into(key, total, lambda space: digest.append(encode_block_into(header, block.data, space)))
            return digest[0] if ok else None

        return self._insert(header, total, write)

    def put_encoded(self, encoded) -> PutResult:
        """Store an encoded block (verified first: L2 never holds bytes it could not serve).

        A bytearray is kept as is (no copy): the caller hands it over.
        """
        header, _, total = decode_header(encoded)
        if header.fingerprint != self.fingerprint:
            raise ValueError(f"fingerprint mismatch: block {header.fingerprint[:12]}.. vs tier {self.fingerprint[:12]}..")
        data = encoded if len(encoded) == total else memoryview(encoded)[:total]
        return self._insert(header, total, lambda key: checksum_of(data) if self.arena.write(key, data) else None)

    def _insert(self, header: BlockHeader, total: int, write: Callable[[bytes], bytes | None]) -> PutResult:
        """Admit a block of `total` bytes; `write(key)` puts it in the arena and returns its checksum, or
        None when the arena has no room (then the lowest-priority unpinned block goes, and it tries again)."""
        key = header.block_hash
        if key in self._info:  # content-addressed: already here means identical
            self._touch(key)
            return PutResult(True, [], self.handle(key))
        now = self.clock()
        if self._observe is not None:
            self._observe(key, now)
        # Depth counts only ancestors held here (a parent may live in L1 alone).
        parent = self._info.get(header.parent_hash) if header.parent_hash else None
        info = BlockInfo(block_hash=key, parent_hash=header.parent_hash, depth=parent.depth + 1 if parent else 0,
                         num_tokens=header.block_size, size_bytes=total, created_at=now, last_access=now)
        if total > self.capacity_bytes or not self.policy.admit(info, now):
            self.refused_blocks += 1
            return PutResult(False, [])
        evicted = self._make_room(total, now)
        if evicted is None:
            self.refused_blocks += 1
            return PutResult(False, [])
        while (checksum := write(key)) is None:  # the arena's own limits (a slab's holes, its directory)
            victim = self._lowest_unpinned(now)
            if victim is None:
                self.refused_blocks += 1
                self.evicted_blocks += len(evicted)
                return PutResult(False, evicted)
            self.remove(victim)
            evicted.append(victim)
        self.evicted_blocks += len(evicted)
        self._info[key] = info
        self._checksums[key] = checksum
        self.used_bytes += total
        if parent:
            parent.num_children += 1
        return PutResult(True, evicted, self._handle(key, total, checksum))

    def get_encoded(self, block_hash: bytes) -> memoryview | Miss:
        """The stored bytes, unverified (a peer or L3 writer verifies on its side)."""
        buf = self.arena.read(block_hash) if block_hash in self._info else None
        if buf is None:
            return self.counters.record(Miss(Tier.L2, MissReason.NOT_FOUND))
        self._touch(block_hash)
        return buf

    def get(self, block_hash: bytes) -> StoredBlock | Miss:
        """A verified block (zero-copy view of the stored bytes) or a counted miss."""
        buf = self.get_encoded(block_hash)
        if isinstance(buf, Miss):
            return buf
        got = decode_or_miss(buf, self.fingerprint, block_hash, Tier.L2, self.counters)
        if isinstance(got, Miss):  # corrupted in memory: drop it, never serve it again
            self.remove(block_hash)
        return got

    def handle(self, block_hash: bytes) -> BlockHandle | None:
        info = self._info.get(block_hash)
        if info is None:
            return None
        return self._handle(block_hash, info.size_bytes, self._checksums[block_hash])

    def pin(self, block_hash: bytes, until: float) -> None:
        if block_hash in self._info:
            self._info[block_hash].pinned_until = until

    def is_pinned(self, block_hash: bytes, now: float) -> bool:
        info = self._info.get(block_hash)
        return info is not None and info.pinned_until > now

    def remove(self, block_hash: bytes) -> bool:
        info = self._info.pop(block_hash, None)
        if info is None:
            return False
        self._checksums.pop(block_hash, None)
        self.arena.free(block_hash)
        self.used_bytes -= info.size_bytes
        parent = self._info.get(info.parent_hash) if info.parent_hash else None
        if parent:
            parent.num_children -= 1
        return True

    def close(self) -> None:
        self.arena.close()
        self._info.clear()
        self._checksums.clear()
        self.used_bytes = 0

    def _touch(self, key: bytes) -> None:
        info = self._info[key]
        info.last_access = self.clock()
        info.access_count += 1
        if self._observe is not None:
            self._observe(key, info.last_access)

    def _make_room(self, need: int, now: float) -> list[bytes] | None:
        """Evict lowest-priority unpinned blocks until `need` fits; None if pins prevent it."""
        if self.used_bytes + need <= self.capacity_bytes:
            return []
        candidates = sorted((self.policy.priority(i, now), k) for k, i in self._info.items() if i.pinned_until <= now)
        free = self.capacity_bytes - self.used_bytes
        victims: list[bytes] = []
        for _, key in candidates:
            if free >= need:
                break
            victims.append(key)
            free += self._info[key].size_bytes
        if free < need:
            return None
        for key in victims:
            self.remove(key)
        return victims

    def _lowest_unpinned(self, now: float) -> bytes | None:
        unpinned = ((self.policy.priority(i, now), k) for k, i in self._info.items() if i.pinned_until <= now)
        return min(unpinned, default=(None, None))[1]

    def _handle(self, key: bytes, size: int, checksum: bytes) -> BlockHandle:
        return BlockHandle(block_hash=key.hex(), tier=Tier.L2, worker_id=self.worker_id, size=size,
                           checksum=checksum.hex())
