"""Which blocks a worker should let go of: the policy's order, leaf-first, never a protected block.

`plan_demotion` is a pure function of a tier's blocks and their stats: when
the tier holds more than `high` x capacity blocks, it picks blocks to leave
until `low` x capacity remain. The order is the same priority function the
engine and the simulator run (shared/cache_policy); only leaves go (a block
whose cached child stays is kept, so a chain in a tier is always a prefix),
and a protected block (pinned, in use, or without a copy below when one is
required) is never picked, nor, therefore, any ancestor of it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvmesh.cache_policy.base import BlockInfo, EvictionPolicy


@dataclass(slots=True, frozen=True)
class Watermarks:
    high: float = 0.9  # advice starts above this share of capacity
    low: float = 0.75  # ... and aims to bring the tier down to this share

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise ValueError(f"need 0 <= low <= high <= 1, got low={self.low} high={self.high}")


def plan_demotion(blocks: Mapping[bytes, BlockInfo], capacity: int, marks: Watermarks, policy: EvictionPolicy,
                  now: float, protected: Callable[[bytes], bool]) -> list[bytes]:
    """Hashes to move out of a tier holding `blocks`, lowest priority first; [] below the high-water mark."""
    if capacity <= 0 or len(blocks) <= marks.high * capacity:
        return []
    want = len(blocks) - math.floor(marks.low * capacity)
    children: dict[bytes, int] = {}
    for info in blocks.values():
        if info.parent_hash in blocks:
            children[info.parent_hash] = children.get(info.parent_hash, 0) + 1
    heap = [(policy.priority(i, now), h) for h, i in blocks.items() if not children.get(h)]
    heapq.heapify(heap)
    out: list[bytes] = []
    while heap and len(out) < want:
        _, h = heapq.heappop(heap)
        if protected(h):
            continue  # stays, and so does every ancestor (it never becomes a leaf)
        out.append(h)
        parent = blocks[h].parent_hash
        if parent in children:
            children[parent] -= 1
            if children[parent] == 0:
                heapq.heappush(heap, (policy.priority(blocks[parent], now), parent))
    return out
