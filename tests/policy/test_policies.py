"""Each policy's ordering on hand-built blocks, and the registry."""

from __future__ import annotations

import pytest
from kvmesh.cache_policy.base import BlockInfo, LRUPolicy
from kvmesh.cache_policy.cost import CostParams, CostPolicy
from kvmesh.cache_policy.lfu import LFUPolicy
from kvmesh.cache_policy.registry import POLICIES, get_policy
from kvmesh.cache_policy.tinylfu import TinyLFUPolicy


def block(name: str, *, depth: int = 0, last: float = 0.0, count: int = 1, children: int = 0, size: int = 1) -> BlockInfo:
    return BlockInfo(
        block_hash=name.encode(),
        parent_hash=None,
        depth=depth,
        num_tokens=512,
        size_bytes=size,
        created_at=0.0,
        last_access=last,
        access_count=count,
        num_children=children,
    )


def evict_order(policy, blocks: list[BlockInfo], now: float = 100.0) -> list[str]:
    return [b.block_hash.decode() for b in sorted(blocks, key=lambda b: policy.priority(b, now))]


def test_lru_oldest_first() -> None:
    blocks = [block("new", last=9), block("old", last=1, count=50), block("mid", last=5)]
    assert evict_order(LRUPolicy(), blocks) == ["old", "mid", "new"]


def test_lfu_count_then_recency() -> None:
    blocks = [block("hot", last=1, count=5), block("cold-new", last=9), block("cold-old", last=2)]
    assert evict_order(LFUPolicy(), blocks) == ["cold-old", "cold-new", "hot"]


def test_lfu_recency_tiebreak_survives_large_clocks() -> None:
    # a monotonic clock ~ 11 days in: 1 ms apart must still order
    a, b = block("a", last=1e6), block("b", last=1e6 + 1e-3)
    assert evict_order(LFUPolicy(), [b, a], now=2e6) == ["a", "b"]


def test_tinylfu_admits_from_second_request() -> None:
    p = TinyLFUPolicy(history_entries=4)
    b = block("x")
    p.on_access(b.block_hash, 0.0)
    assert not p.admit(b, 0.0)
    p.on_access(b.block_hash, 1.0)
    assert p.admit(b, 1.0)


def test_tinylfu_history_is_bounded() -> None:
    p = TinyLFUPolicy(history_entries=2)
    for name in (b"a", b"b", b"c"):
        p.on_access(name, 0.0)
    assert len(p.history) == 2
    p.on_access(b"a", 1.0)  # "a" was forgotten: this is a first request again
    assert not p.admit(block("a"), 1.0)


def test_cost_prefers_frequent_remembered_across_evictions() -> None:
    p = CostPolicy()
    for _ in range(4):
        p.on_access(b"hot", 0.0)
    p.on_access(b"cold", 0.0)
    # both freshly re-cached (access_count 1): the history still tells them apart
    assert evict_order(p, [block("hot", last=5), block("cold", last=5)]) == ["cold", "hot"]


def test_cost_grows_with_depth_children_and_shrinks_with_bytes() -> None:
    p = CostPolicy()
    assert p.priority(block("deep", depth=60), 0) > p.priority(block("shallow", depth=0), 0)
    assert p.priority(block("branch", children=3), 0) > p.priority(block("leaf"), 0)
    assert p.priority(block("big", size=2), 0) < p.priority(block("small", size=1), 0)


def test_cost_decays_with_idle_time() -> None:
    p = CostPolicy(CostParams(tau_s=10.0))
    # 3x the reuse is worth about ln(3) * tau = 11 s of idleness
    assert evict_order(p, [block("busy-but-idle", last=0, count=3), block("fresh", last=20)]) == ["busy-but-idle", "fresh"]
    assert evict_order(p, [block("busy", last=15, count=3), block("fresh", last=20)]) == ["fresh", "busy"]


def test_cost_order_does_not_depend_on_now() -> None:
    p = CostPolicy()
    blocks = [block("a", last=3, count=2), block("b", last=9), block("c", last=1, depth=40)]
    assert evict_order(p, blocks, now=10) == evict_order(p, blocks, now=10_000)


def test_cost_lets_a_block_displace_others_from_its_second_request() -> None:
    p = CostPolicy()
    p.on_access(b"new", 0.0)
    assert p.admit(block("new"), 0.0)  # free room is always taken
    assert not p.may_displace(block("new"), 0.0)
    p.on_access(b"new", 1.0)
    assert p.may_displace(block("new"), 1.0)
    pinned = block("pinned-new")
    pinned.pinned_until = 10.0
    p.on_access(b"pinned-new", 2.0)
    assert p.may_displace(pinned, 2.0)  # a client's pin outranks the doorkeeper
    assert not p.may_displace(pinned, 11.0)


def test_registry() -> None:
    assert set(POLICIES) == {"default", "cost", "lru", "lfu", "tinylfu", "session", "continuum"}
    for name in POLICIES:
        assert get_policy(name).name == name
    assert get_policy("cost") is not get_policy("cost")  # history is per object
    with pytest.raises(ValueError, match="unknown eviction policy"):
        get_policy("fifo")
