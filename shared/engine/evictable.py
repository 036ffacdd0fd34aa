"""The set of cached blocks no sequence uses, ordered for eviction.

Two orderings behind one small interface: an insertion-ordered queue for
LRU (O(1); a block enters when its last user releases it, so insertion
order is last-access order) and a heap with lazy invalidation for any other
`EvictionPolicy`, whose priority is taken when the block becomes evictable.
Among equal priorities the deeper block (a chain's tail) goes first, so a
chain is evicted from its end and its prefix stays reachable.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Protocol

from kvmesh.cache_policy.base import BlockInfo, EvictionPolicy, LRUPolicy


class Evictable(Protocol):
    def add(self, block_id: int, info: BlockInfo, now: float) -> None: ...

    def discard(self, block_id: int) -> None: ...

    def pop(self) -> int | None:
        """Remove and return the block to evict next, or None if empty."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, block_id: int) -> bool: ...


class LRUQueue:
    """Least recently released first; O(1) add, discard and pop."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, block_id: int, info: BlockInfo, now: float) -> None:
        self._order[block_id] = None
        self._order.move_to_end(block_id)

    def discard(self, block_id: int) -> None:
        self._order.pop(block_id, None)

    def pop(self) -> int | None:
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order


class PriorityHeap:
    """Lowest `policy.priority` first; discarded entries are skipped on pop."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self._policy = policy
        self._heap: list[tuple[float, int, int, int]] = []  # (priority, -depth, seq, block_id)
        self._live: dict[int, int] = {}  # block_id -> seq of its current heap entry
        self._seq = itertools.count()

    def add(self, block_id: int, info: BlockInfo, now: float) -> None:
        seq = next(self._seq)
        self._live[block_id] = seq
        heapq.heappush(self._heap, (self._policy.priority(info, now), -info.depth, seq, block_id))

    def discard(self, block_id: int) -> None:
        self._live.pop(block_id, None)
        if len(self._heap) > 4 * len(self._live) + 1024:  # mostly dead entries (re-keys, takes): compact
            self._heap = [e for e in self._heap if self._live.get(e[3]) == e[2]]
            heapq.heapify(self._heap)

    def pop(self) -> int | None:
        while self._heap:
            _, _, seq, block_id = heapq.heappop(self._heap)
            if self._live.get(block_id) == seq:
                del self._live[block_id]
                return block_id
        return None

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._live


def make_evictable(policy: EvictionPolicy) -> Evictable:
    """The fast queue for plain LRU, the generic heap for everything else."""
    if type(policy) is LRUPolicy:
        return LRUQueue()
    return PriorityHeap(policy)
