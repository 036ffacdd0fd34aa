"""What a policy sees of a block, and what a policy is.

A policy maps a block's statistics to a priority; the cache evicts the
block with the *lowest* priority among those that are evictable (not in
use, not pinned). Policies that also decide admission (S3-FIFO, TinyLFU)
implement ``admit``; pure priority policies admit everything. A policy
may also gate only the blocks that would displace a cached one
(``DisplacementGate``): free room costs nothing, an eviction does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(slots=True)
class BlockInfo:
    """Access statistics of one cached block (times in seconds, any monotonic clock)."""

    block_hash: bytes
    parent_hash: bytes | None
    depth: int  # position in its chain: 0 for the first block of a prompt
    num_tokens: int
    size_bytes: int
    created_at: float
    last_access: float
    access_count: int = 1
    num_children: int = 0  # cached children; a block with children is not a leaf
    pinned_until: float = 0.0  # TTL pin from cache_control breakpoints / named caches


class EvictionPolicy(Protocol):
    name: str

    def priority(self, info: BlockInfo, now: float) -> float:
        """Lower is evicted first."""
        ...

    def admit(self, info: BlockInfo, now: float) -> bool:
        """Whether a newly computed block is worth caching at all."""
        ...


@runtime_checkable
class AccessObserver(Protocol):
    """Optional side of a policy that keeps history across evictions (frequency, ghosts).

    A cache calls ``on_access`` once per block of every request, hit or miss,
    before asking ``priority``/``admit`` about that request's blocks.
    """

    def on_access(self, block_hash: bytes, now: float) -> None: ...


@runtime_checkable
class DisplacementGate(Protocol):
    """Optional side of a policy: whether a new, admitted block may evict a cached one.

    Asked only when the cache is full; a block refused here is not cached
    (nor the rest of its chain), exactly like one ``admit`` refused.
    """

    def may_displace(self, info: BlockInfo, now: float) -> bool: ...


class LRUPolicy:
    """Least recently used: the oldest last access goes first."""

    name = "lru"

    def priority(self, info: BlockInfo, now: float) -> float:
        return info.last_access

    def admit(self, info: BlockInfo, now: float) -> bool:
        return True
