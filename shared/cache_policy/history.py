"""Bounded access history that outlives eviction (a ghost list with counts).

A block's ``BlockInfo.access_count`` restarts at 1 each time it is cached
again, so a policy that only sees the cache forgets every block it evicts.
``AccessHistory`` remembers how often the most recently seen
``max_entries`` distinct blocks were requested; the least recently seen
entry is forgotten first, so memory stays bounded and old popularity fades.
"""

from __future__ import annotations

from kvmesh.lru import BoundedLRU

DEFAULT_HISTORY_ENTRIES = 1 << 16  # ~ a few MiB: keys plus small ints


class AccessHistory:
    """Request counts of recently seen block hashes, LRU-bounded."""

    def __init__(self, max_entries: int = DEFAULT_HISTORY_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._counts: BoundedLRU[bytes, int] = BoundedLRU(max_entries)

    def __len__(self) -> int:
        return len(self._counts)

    def record(self, block_hash: bytes) -> int:
        """Count one request of ``block_hash``; returns its count including this one."""
        count = (self._counts.get(block_hash) or 0) + 1
        self._counts.put(block_hash, count)
        return count

    def count(self, block_hash: bytes) -> int:
        """Remembered requests of ``block_hash`` (0 if never seen or forgotten)."""
        return self._counts.get(block_hash) or 0
