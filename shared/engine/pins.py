"""TTL pins on cached blocks: a pinned block is not evicted until its time passes.

A pin holds one reference on the block (so it is out of the evictable set)
and a wall-clock deadline; pinning a pinned block only moves its deadline
later (a hit with the same pin refreshes it). `expire(now)` drops the
references of pins whose time has passed; the engine calls it every step.

Pins have a budget, `limit` blocks (a fraction of the pool, set by the
engine): a pin that would pass it keeps only the leading run that fits, so
no tenant, breakpoint or agent session can hold so much of the pool that
requests starve. Extending a block already pinned costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.engine.block_hash import BlockHash
from shared.engine.block_pool import Block
from shared.engine.prefix_cache import PrefixCache


class PinSet:
    def __init__(self, cache: PrefixCache, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"pin limit must be >= 0, got {limit}")
        self._cache = cache
        self.limit = limit
        self._pins: dict[BlockHash, tuple[Block, float]] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._pins

    def pin(self, hashes: Sequence[BlockHash], until: float) -> int:
        """Pin the leading cached run of `hashes` until `until` (unix seconds), within the budget;
        returns how many are pinned."""
        pinned = 0
        for h in hashes:
            held = self._pins.get(h)
            if held is not None:
                self._pins[h] = (held[0], max(held[1], until))
            else:
                block = self._cache.get(h)
                if block is None or len(self._pins) >= self.limit:
                    break
                self._cache.acquire(block)
                self._pins[h] = (block, until)
            pinned += 1
        return pinned

    def expire(self, now: float) -> int:
        """Release pins whose deadline has passed; returns how many."""
        done = [h for h, (_, until) in self._pins.items() if until <= now]
        if done:
            self._cache.release([self._pins.pop(h)[0] for h in done])
        return len(done)
