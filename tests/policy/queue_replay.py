"""Checked replays for queue-structured policies: the chain rules every ``QueueCache`` must keep.

Shared by the S3-FIFO and ARC tests; each adds its own algorithm's
invariants through ``check``, called with the queues after every request.
"""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.cache_policy.policy_cache import BlockSpec
from kvmesh.cache_policy.queue_cache import QueueAlgorithm, QueueCache, QueuePolicy
from kvmesh.sim.tiers import TieredCache
from kvmesh.sim.trace import Trace


def chain(*names: str) -> list[BlockSpec]:
    return [BlockSpec(block_hash=n.encode()) for n in names]


def check_chains(cache: QueueCache, rooted: bool = True) -> None:
    """``num_children`` counts exactly a block's cached children; ``rooted`` (L1): every parent is cached too."""
    children = {h: 0 for h in cache.blocks}
    for info in cache.blocks.values():
        if rooted:
            assert info.parent_hash is None or info.parent_hash in cache.blocks, "a child outlived its parent"
        if info.parent_hash in children:
            children[info.parent_hash] += 1
    assert all(cache.blocks[h].num_children == n for h, n in children.items())


def replay_checked(policy: QueuePolicy, trace: Trace, capacity: int,
                   check: Callable[[QueueAlgorithm], None]) -> int:
    """Replay ``trace`` through one ``QueueCache``, asserting the rules after each request; returns hit blocks."""
    cache = QueueCache(policy, capacity)
    hits = 0
    for request in trace.requests:
        before = set(cache.blocks)
        result = cache.insert([BlockSpec(block_hash=b) for b in request.blocks], request.time_s)
        hit = request.blocks[: result.hit_blocks]
        assert set(hit) <= before, "a hit on a block that was not cached"
        assert len(cache) <= capacity and len(cache.queues) == len(cache)
        assert set(result.evicted) <= before
        assert not set(result.evicted) & set(request.blocks), "evicted a block of the in-flight request"
        assert cache.match_prefix(list(request.blocks)) == result.hit_blocks + result.inserted
        check_chains(cache)
        check(cache.queues)
        hits += result.hit_blocks
    return hits


def replay_tiers_checked(policy: QueuePolicy, trace: Trace, l1: int, l2: int) -> None:
    """Replay through L1 over L2: each tier within its capacity, a block in one tier at a time."""
    tiers = TieredCache(policy, l1, l2)
    for request in trace.requests:
        specs = [BlockSpec(block_hash=b) for b in request.blocks]
        before_l1, before_l2 = set(tiers.l1.blocks), set(tiers.l2.blocks)
        hits = tiers.request(specs, request.time_s)
        assert set(request.blocks[: hits.l1]) <= before_l1
        assert set(request.blocks[hits.l1: hits.l1 + hits.l2]) <= before_l2
        for tier, capacity in ((tiers.l1, l1), (tiers.l2, l2)):
            assert len(tier) <= capacity and len(tier.queues) == len(tier)
        assert not set(tiers.l1.blocks) & set(tiers.l2.blocks)
        check_chains(tiers.l1)
        check_chains(tiers.l2, rooted=False)


def scan_then_reuse(cache) -> int:
    """A hot chain read twice, then one-time chains worth twice a 10-block cache, then the hot chain: its hit.

    LRU keeps what was read last, so the scan flushes the hot chain (0);
    a policy that tells twice-read blocks from once-read ones keeps it (4).
    """
    hot = chain("h0", "h1", "h2", "h3")
    cache.insert(hot, 0.0)
    cache.insert(hot, 1.0)
    for i in range(6):
        cache.insert(chain(f"s{i}a", f"s{i}b", f"s{i}c"), 2.0 + i)
    return cache.insert(hot, 10.0).hit_blocks
