"""Replay a trace through a ``PolicyCache``: prefix-hit blocks / input blocks.

Time is the trace timestamp. Each request first counts its prefix hit (the
longest run of its leading blocks that is cached), then all its blocks are
touched or inserted (subject to admission) with eviction down to capacity,
never evicting the request's own blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.cache_policy.base import EvictionPolicy
from shared.cache_policy.policy_cache import BlockSpec, PolicyCache
from shared.sim.trace import Trace

Progress = Callable[[int], None]


@dataclass(slots=True, frozen=True)
class ReplayResult:
    policy: str
    capacity_blocks: int
    hit_blocks: int
    input_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.input_blocks if self.input_blocks else 0.0


def replay(
    trace: Trace,
    policy: EvictionPolicy,
    capacity: int,
    progress: Progress | None = None,
    cache: PolicyCache | None = None,
    on_request: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Run every request of ``trace`` in order.

    ``on_request(i)`` runs before request ``i`` (an oracle policy follows the
    replay with it); ``progress(1)`` after each request; ``cache`` lets a
    caller inspect the cache afterwards.
    """
    cache = cache if cache is not None else PolicyCache(policy, capacity)
    hits = total = 0
    for i, request in enumerate(trace.requests):
        if on_request is not None:
            on_request(i)
        specs = [BlockSpec(block_hash=b, num_tokens=request.block_tokens(k)) for k, b in enumerate(request.blocks)]
        result = cache.insert(specs, request.time_s)
        hits += result.hit_blocks
        total += len(specs)
        if progress is not None:
            progress(1)
    return ReplayResult(policy.name, capacity, hits, total)


def infinite_hit_rate(trace: Trace) -> ReplayResult:
    """The ceiling: a cache that never evicts (prefix semantics)."""
    seen: set[bytes] = set()
    hits = total = 0
    for request in trace.requests:
        for b in request.blocks:
            if b not in seen:
                break
            hits += 1
        total += len(request.blocks)
        seen.update(request.blocks)
    return ReplayResult("infinite", trace.unique_blocks, hits, total)
