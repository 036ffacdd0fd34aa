"""TTL pins on cached blocks: a pinned block is not evicted until its time passes.

A pin holds one reference on the block (so it is out of the evictable set)
and a wall-clock deadline; pinning a pinned block only moves its deadline
later (a hit with the same pin refreshes it). `expire(now)` drops the
references of pins whose time has passed; the engine calls it every step.

Pins have budgets, counted in blocks by a `PinLedger`: `limit` for the pool
(engine.pin_fraction) and `tenant_limit` for each tenant's pins
(engine.pin_tenant_fraction; cache_control breakpoints and named caches).
The policy's own pins (session retains and prefetches: tenant "") are bound
by the pool's limit only. A pin that would pass a budget keeps only the
leading run that fits, so no tenant,
breakpoint or agent session can hold so much of the pool that requests
starve. Extending a block already pinned costs nothing.

Pins are advice, never a wait: when the scheduler cannot otherwise make
progress (nothing runs and the next request does not fit, or the only
running request cannot grow), `yield_idle` drops the pins of blocks only a
pin holds, furthest predicted use first (the latest deadline; a chain's
tail before its start), and counts them in `num_yielded`. The blocks stay
cached and evictable: a dropped pin costs at most a later miss.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvmesh.cache_policy.pin_ledger import PinGrant, PinLedger
from kvmesh.engine.block_pool import Block
from kvmesh.engine.prefix_cache import PrefixCache
from kvmesh.protocol.block_hash import BlockHash


class PinSet:
    def __init__(self, cache: PrefixCache, limit: int, tenant_limit: int | None = None) -> None:
        if limit < 0:
            raise ValueError(f"pin limit must be >= 0, got {limit}")
        self._cache = cache
        self.limit = limit
        self.ledger = PinLedger(limit, tenant_limit)
        self._blocks: dict[BlockHash, Block] = {}
        self.num_yielded = 0  # pins dropped before their deadline so that a request could run

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def pin(self, hashes: Sequence[BlockHash], until: float) -> int:
        """Pin the leading cached run of `hashes` until `until` (unix seconds), within the pool's budget;
        returns how many are pinned."""
        return self.pin_for("", hashes, until).granted

    def pin_for(self, tenant: str, hashes: Sequence[BlockHash], until: float, now: float | None = None) -> PinGrant:
        """Pin the leading cached run of `hashes` for `tenant` until `until`, within its budget and the pool's."""
        now = time.time() if now is None else now
        self.expire(now)  # the ledger then forgets nothing behind this set's back
        run: list[BlockHash] = []
        for h in hashes:
            if h not in self._blocks and self._cache.get(h) is None:
                break
            run.append(h)
        grant = self.ledger.grant(tenant, run, 1, until, now, trim=True)
        for h in run[:grant.granted]:
            if h not in self._blocks:
                block = self._cache.get(h)
                self._cache.acquire(block)
                self._blocks[h] = block
        return grant

    def expire(self, now: float) -> int:
        """Release pins whose deadline has passed; returns how many."""
        done = self.ledger.expire(now)
        if done:
            self._cache.release([self._blocks.pop(h) for h in done])
        return len(done)

    def yield_idle(self, n: int, keep: frozenset[int] = frozenset()) -> int:
        """Drop up to `n` pins whose block nothing but the pin holds (and whose id is not in `keep`),
        the latest deadline first and, among equal ones, the deepest block first; returns how many."""
        if n <= 0:
            return 0
        idle = [(h, b) for h, b in self._blocks.items() if b.ref_count == 1 and b.block_id not in keep]
        if not idle:
            return 0

        def furthest_first(item: tuple[BlockHash, Block]) -> tuple[float, int]:
            info = self._cache.info(item[1])
            return self.ledger.until(item[0]), info.depth if info is not None else 0

        idle.sort(key=furthest_first, reverse=True)
        take = idle[:n]
        self.ledger.release([h for h, _ in take])
        for h, _ in take:
            del self._blocks[h]
        # release() frees the last block of its list first: pass roots first so tails are evicted first.
        self._cache.release([b for _, b in reversed(take)])
        self.num_yielded += len(take)
        return len(take)
