"""Warm-up planning: which L3 chunks a newly started worker should pull into its L2 first.

The hottest by the same policy that ranks evictions (highest priority
first), counting each chunk's accesses as the stats the service heard for
its last block; expired chunks are skipped (GC is about to delete them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvmesh.cache_policy.base import BlockInfo, EvictionPolicy
from kvmesh.eviction.l3_gc import L3Object


def plan_warm(objects: Iterable[L3Object], policy: EvictionPolicy, now: float, limit: int,
              stats: Callable[[bytes], BlockInfo | None]) -> list[str]:
    """Up to `limit` chunk keys, hottest first."""
    ranked: list[tuple[float, str]] = []
    for obj in objects:
        if obj.expires_at <= now:
            continue
        seen = stats(obj.last_hash)
        last = max(obj.last_access, seen.last_access if seen is not None else 0.0)
        count = seen.access_count if seen is not None else 1
        info = BlockInfo(obj.last_hash, None, 0, max(obj.blocks, 1), max(obj.size, 1), obj.last_access, last,
                         max(count, 1))
        ranked.append((policy.priority(info, now), obj.key))
    ranked.sort(reverse=True)
    return [key for _, key in ranked[:limit]]
