"""Hash -> block map over the pool: find cached prefixes, keep freed blocks until reused.

Life of a block: taken from the pool for a sequence (ref 1); once its K/V
are computed and it is full, `store` registers it under its chained hash;
other sequences with the same prefix `acquire` it (ref +1); when the last
user releases it, it stays cached but becomes evictable; `allocate` reuses
uncached free blocks first and evicts (lowest policy priority first) only
when none are left. A hash hit counts only if the block's stored token ids
equal the ones asked for: a collision is a miss, never served.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.cache_policy.base import BlockInfo, EvictionPolicy, LRUPolicy
from kvmesh.engine.block_pool import Block, BlockPool
from kvmesh.engine.evictable import make_evictable
from kvmesh.protocol.block_hash import BlockHash


class KVEventListener(Protocol):
    """Told when a block enters or leaves the cache (for KV event publishing)."""

    def block_stored(self, block_hash: BlockHash, parent_hash: BlockHash | None, num_tokens: int) -> None: ...

    def block_removed(self, block_hash: BlockHash) -> None: ...


class NullListener:
    def block_stored(self, block_hash: BlockHash, parent_hash: BlockHash | None, num_tokens: int) -> None:
        return None

    def block_removed(self, block_hash: BlockHash) -> None:
        return None


@dataclass(slots=True)
class CacheStats:
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    collisions: int = 0  # hash hits whose stored tokens differed (served as misses)
    stored: int = 0
    rejected: int = 0  # blocks the policy did not admit


class PrefixCache:
    """Prefix lookup, reference-counted sharing and eviction over a `BlockPool`."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        policy: EvictionPolicy | None = None,
        listener: KVEventListener | None = None,
        clock: Callable[[], float] = time.monotonic,
        block_bytes: int = 0,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.policy: EvictionPolicy = policy if policy is not None else LRUPolicy()
        self.listener: KVEventListener = listener if listener is not None else NullListener()
        self.stats = CacheStats()
        self._clock = clock
        self._block_bytes = block_bytes
        self._by_hash: dict[BlockHash, int] = {}
        self._info: dict[int, BlockInfo] = {}  # block_id -> stats, for cached blocks
        self._evictable = make_evictable(self.policy)
        # Policies that keep history across evictions (TinyLFU ...) see every queried block.
        self._observe: Callable[[bytes, float], None] | None = getattr(self.policy, "on_access", None)

    # --- lookup -------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash], token_ids: Sequence[int]) -> list[Block]:
        """The longest leading run of `hashes` that is cached with matching tokens. No side effects."""
        found: list[Block] = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            block = self.pool.blocks[block_id]
            if block.token_ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            found.append(block)
        return found

    def acquire_prefix(self, hashes: Sequence[BlockHash], token_ids: Sequence[int]) -> list[Block]:
        """Look up and take a reference on the cached prefix; counts the query."""
        found = self.lookup(hashes, token_ids)
        if len(found) < len(hashes) and hashes[len(found)] in self._by_hash:
            self.stats.collisions += 1
        self.stats.queries += 1
        self.stats.query_tokens += len(token_ids)
        self.stats.hit_tokens += len(found) * self.block_size
        now = self._clock()
        if self._observe is not None:
            for h in hashes:
                self._observe(h, now)
        for block in found:
            self._take(block, now)
        return found

    def get(self, block_hash: BlockHash) -> Block | None:
        block_id = self._by_hash.get(block_hash)
        return None if block_id is None else self.pool.blocks[block_id]

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._by_hash

    def __len__(self) -> int:
        return len(self._by_hash)

    # --- allocation ---------------------------------------------------

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_allocatable(self) -> int:
        """Blocks `allocate` can hand out now: free ones plus evictable cached ones."""
        return self.pool.num_free + len(self._evictable)

    def allocate(self, n: int) -> list[Block] | None:
        """n blocks with ref 1, all or nothing; evicts cached blocks only when the free list is empty."""
        if n > self.num_allocatable:
            return None
        out: list[Block] = []
        for _ in range(n):
            block = self.pool.take_free()
            if block is None:
                block = self._evict_one()
            out.append(block)
        return out

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference on each block; tail first, so a chain's end is evicted before its start."""
        now = self._clock()
        for block in reversed(blocks):
            if self.pool.decref(block) > 0:
                continue
            if block.block_hash is None:
                self.pool.put_free(block)
            else:
                info = self._info[block.block_id]
                info.last_access = now
                self._evictable.add(block.block_id, info, now)

    def acquire(self, block: Block) -> None:
        """Take a reference on one cached block (it leaves the evictable set while held)."""
        self._take(block, self._clock())

    # --- caching ------------------------------------------------------

    def store(
        self,
        block: Block,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: tuple[int, ...],
        depth: int,
    ) -> bool:
        """Cache a full, computed block in use. False if the hash is already cached or not admitted."""
        if block.block_hash is not None or block_hash in self._by_hash:
            return False
        now = self._clock()
        info = BlockInfo(
            block_hash=block_hash,
            parent_hash=parent_hash,
            depth=depth,
            num_tokens=len(token_ids),
            size_bytes=self._block_bytes,
            created_at=now,
            last_access=now,
        )
        if not self.policy.admit(info, now):
            self.stats.rejected += 1
            return False
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = token_ids
        self._by_hash[block_hash] = block.block_id
        self._info[block.block_id] = info
        parent_id = self._by_hash.get(parent_hash) if parent_hash is not None else None
        if parent_id is not None:
            self._info[parent_id].num_children += 1
        self.stats.stored += 1
        self.listener.block_stored(block_hash, parent_hash, len(token_ids))
        return True

    def info(self, block: Block) -> BlockInfo | None:
        return self._info.get(block.block_id)

    def rekey(self, hashes: Iterable[BlockHash]) -> int:
        """Rank again the evictable blocks among `hashes` whose priority moved outside their own accesses
        (a session-aware policy learned when their session is back); how many were re-ranked."""
        now = self._clock()
        n = 0
        for h in hashes:
            block_id = self._by_hash.get(h)
            if block_id is not None and block_id in self._evictable:
                self._evictable.discard(block_id)
                self._evictable.add(block_id, self._info[block_id], now)
                n += 1
        return n

    # --- internals ----------------------------------------------------

    def _take(self, block: Block, now: float) -> None:
        if block.ref_count == 0:
            self._evictable.discard(block.block_id)
        self.pool.incref(block)
        info = self._info[block.block_id]
        info.last_access = now
        info.access_count += 1

    def drop(self, block_hash: BlockHash) -> bool:
        """Uncache an unreferenced leaf now and free its slot (a demotion the eviction service advised).

        False, and nothing changes, for a block that is absent, in use (pinned included) or a parent.
        """
        block_id = self._by_hash.get(block_hash)
        if block_id is None or block_id not in self._evictable or self._info[block_id].num_children:
            return False
        self._evictable.discard(block_id)
        block = self._uncache(block_id)
        block.ref_count = 0
        self.pool.put_free(block)
        return True

    def _evict_one(self) -> Block:
        block_id = self._evictable.pop()
        if block_id is None:
            raise RuntimeError("no evictable block although num_allocatable said so")
        return self._uncache(block_id)

    def _uncache(self, block_id: int) -> Block:
        """Forget an unreferenced cached block; it comes back with ref 1 (the caller's)."""
        block = self.pool.blocks[block_id]
        block_hash = block.block_hash
        assert block_hash is not None and block.ref_count == 0
        del self._by_hash[block_hash]
        del self._info[block_id]
        parent_id = self._by_hash.get(block.parent_hash) if block.parent_hash is not None else None
        if parent_id is not None and self._info[parent_id].num_children > 0:
            self._info[parent_id].num_children -= 1
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = ()
        block.ref_count = 1
        self.stats.evictions += 1
        self.listener.block_removed(block_hash)
        return block
