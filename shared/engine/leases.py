"""Leases: cached blocks held for a request that is not running yet.

Blocks imported (or found cached) for a request that is still being fetched
or queued would sit unreferenced until it is admitted, and any allocation
could evict them: a restore of gigabytes lost to a neighbour's prefill. A
lease holds one reference per block (like a pin, without a deadline) under
the request's id; the request adopts it when it is added and the lease ends
when the request finishes or is aborted, or by `release` for a request that
never comes. Leased blocks are never evicted; only the scheduler, when it
could otherwise admit nothing at all, breaks leases (newest first), which
costs a recompute, never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.engine.block_pool import Block
from kvmesh.engine.prefix_cache import PrefixCache
from kvmesh.protocol.block_hash import BlockHash


class LeaseSet:
    def __init__(self, cache: PrefixCache) -> None:
        self._cache = cache
        self._leases: dict[str, dict[int, Block]] = {}  # lease -> block_id -> block, chain order

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease: str) -> bool:
        return lease in self._leases

    def held(self, lease: str) -> int:
        """How many blocks `lease` holds."""
        return len(self._leases.get(lease, ()))

    def adopt(self, lease: str, blocks: Sequence[Block]) -> None:
        """Take over the caller's one reference on each block (chain order); a block the lease
        already holds gives its extra reference back."""
        held = self._leases.setdefault(lease, {})
        extra = []
        for block in blocks:
            if block.block_id in held:
                extra.append(block)
            else:
                held[block.block_id] = block
        if extra:
            self._cache.release(extra)

    def hold_cached(self, lease: str, hashes: Sequence[BlockHash]) -> int:
        """Put the leading cached run of `hashes` under `lease`; returns its length."""
        run = []
        for h in hashes:
            block = self._cache.get(h)
            if block is None:
                break
            self._cache.acquire(block)
            run.append(block)
        self.adopt(lease, run)
        return len(run)

    def release(self, lease: str) -> int:
        """End a lease (its blocks become evictable unless someone else holds them); returns how many."""
        held = self._leases.pop(lease, None)
        if not held:
            return 0
        self._cache.release(list(held.values()))  # tail first: a chain's end is evicted before its start
        return len(held)

    def newest_first(self) -> list[str]:
        return list(reversed(self._leases))
