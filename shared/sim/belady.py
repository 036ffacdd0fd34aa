"""Belady's farthest-next-use rule as an oracle policy, for the offline bound.

Under prefix semantics a request that uses a block also uses its parent,
so a parent's next use is never later than its children's: the farthest
next use among cached blocks is always found at a leaf, and the leaf-first
``PolicyCache`` can run this oracle unchanged. Blocks never used again are
not admitted. This is the classic bound's rule, not a proof of optimality
for prefix hits: treat it as an upper-ish reference, not a ceiling.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict

from kvmesh.cache_policy.base import BlockInfo
from kvmesh.sim.trace import Trace


class BeladyPolicy:
    """Evicts the block whose next use (request index) is farthest; needs the whole trace."""

    name = "belady"

    def __init__(self, trace: Trace) -> None:
        uses: dict[bytes, list[int]] = defaultdict(list)
        for i, request in enumerate(trace.requests):
            for b in request.blocks:
                uses[b].append(i)
        self._uses = dict(uses)
        self._cursor = 0

    def at_request(self, index: int) -> None:
        """The replay is about to run request ``index``."""
        self._cursor = index

    def next_use(self, block_hash: bytes) -> float:
        uses = self._uses.get(block_hash, [])
        k = bisect.bisect_right(uses, self._cursor)
        return float(uses[k]) if k < len(uses) else math.inf

    def priority(self, info: BlockInfo, now: float) -> float:
        return -self.next_use(info.block_hash)

    def admit(self, info: BlockInfo, now: float) -> bool:
        return self.next_use(info.block_hash) != math.inf
