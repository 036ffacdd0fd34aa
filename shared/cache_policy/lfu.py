"""Least frequently used, ties broken by recency."""

from __future__ import annotations

from kvmesh.cache_policy.base import BlockInfo

# Recency is squashed into [0, 1) so it only orders blocks of equal count;
# the scale keeps millisecond resolution for clocks up to ~1e6 s.
_RECENCY_SCALE_S = 3600.0


class LFUPolicy:
    """Fewest accesses while cached goes first; among equals, the oldest last access."""

    name = "lfu"

    def priority(self, info: BlockInfo, now: float) -> float:
        t = max(info.last_access, 0.0)
        return info.access_count + t / (t + _RECENCY_SCALE_S)

    def admit(self, info: BlockInfo, now: float) -> bool:
        return True
