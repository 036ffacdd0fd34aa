"""The demotion decision on synthetic occupancy and stats (watermarks, policy order, leaf-first, protection); the view."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.cache_policy.base import BlockInfo
from kvmesh.cache_policy.registry import POLICIES, get_policy
from kvmesh.eviction.decisions import Watermarks, plan_demotion
from kvmesh.eviction.occupancy import OccupancyView
from kvmesh.kv_events.events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WorkerCleared,
)
from kvmesh.protocol.blocks import Tier

from .helpers import chain, infos

MARKS = Watermarks(high=0.9, low=0.5)


def never(_: bytes) -> bool:
    return False


def test_below_high_water_nothing_moves() -> None:
    blocks = infos(chain(9, "a"))
    assert plan_demotion(blocks, 10, MARKS, get_policy("lru"), 100.0, never) == []


def test_over_high_water_goes_down_to_low_leaf_first() -> None:
    a, b = chain(6, "a"), chain(5, "b")
    blocks = {**infos(a, last_access=0.0), **infos(b, last_access=50.0)}  # 11 blocks, capacity 10
    out = plan_demotion(blocks, 10, MARKS, get_policy("lru"), 100.0, never)
    assert len(out) == 11 - 5
    # LRU: chain a is older, so it goes first, from its leaf back to its root.
    assert out == list(reversed(a))


def test_protected_block_and_its_ancestors_stay() -> None:
    a, b = chain(6, "a"), chain(5, "b")
    blocks = {**infos(a, last_access=0.0), **infos(b, last_access=50.0)}
    pinned = {a[3]}  # pinned (or in use) in the middle of the older chain
    out = plan_demotion(blocks, 10, MARKS, get_policy("lru"), 100.0, pinned.__contains__)
    assert set(out).isdisjoint(a[:4])
    assert out[:2] == [a[5], a[4]] and out[2:] == list(reversed(b))[:4]


def test_everything_protected_means_no_advice() -> None:
    a = chain(12, "a")
    assert plan_demotion(infos(a), 10, MARKS, get_policy("cost"), 100.0, {a[-1]}.__contains__) == []


@settings(max_examples=60, deadline=None)
@given(parents=st.lists(st.integers(min_value=-1, max_value=40), min_size=1, max_size=40),
       accesses=st.lists(st.floats(min_value=0, max_value=100), min_size=40, max_size=40),
       protected=st.sets(st.integers(min_value=0, max_value=39)),
       capacity=st.integers(min_value=1, max_value=40), policy=st.sampled_from(POLICIES))
def test_any_forest_never_protected_always_leaf_first(parents, accesses, protected, capacity, policy) -> None:
    hashes = [bytes([i]) * 32 for i in range(len(parents))]
    blocks: dict[bytes, BlockInfo] = {}
    for i, p in enumerate(parents):
        parent = hashes[p] if 0 <= p < i else None  # only earlier blocks can be parents: a forest
        depth = blocks[parent].depth + 1 if parent else 0
        blocks[hashes[i]] = BlockInfo(hashes[i], parent, depth, 16, 1024, 0.0, accesses[i])
    guard = {hashes[i] for i in protected if i < len(hashes)}
    out = plan_demotion(blocks, capacity, MARKS, get_policy(policy), 200.0, guard.__contains__)
    assert not guard & set(out)
    assert len(out) == len(set(out)) <= max(0, len(blocks) - int(MARKS.low * capacity))
    gone: set[bytes] = set()
    for h in out:  # when a block goes, every child of it in the tier has gone before
        assert all(c in gone for c, i in blocks.items() if i.parent_hash == h)
        gone.add(h)
    if len(blocks) > MARKS.high * capacity and not guard:
        assert len(out) == len(blocks) - int(MARKS.low * capacity)


def test_view_prunes_stats_of_blocks_held_nowhere_oldest_first() -> None:
    view = OccupancyView()
    a, b = chain(3, "a"), chain(3, "b")
    events = [WorkerCleared(seq=1, epoch=1),
              BlockStored(seq=2, hashes=[h.hex() for h in a], tokens_per_block=16, tier=Tier.L1),
              BlockStored(seq=3, hashes=[h.hex() for h in b], tokens_per_block=16, tier=Tier.L1),
              BlockRemoved(seq=4, hashes=[h.hex() for h in a[1:]], tier=Tier.L1)]
    for i, ev in enumerate(events):  # one batch each, one second apart
        view.apply(KVEventBatch(worker="w", epoch=1, events=[ev]), now=float(i))
    assert view.workers["w"].count(Tier.L1) == 4 and view.stats[b[2]].parent_hash == b[1]
    assert view.prune(max_stats=10) == 0
    assert view.prune(max_stats=5) == 1 and len(view.stats) == 5
    assert view.prune(max_stats=0) == 1  # only a[1:] were held nowhere; held blocks keep their stats
    assert set(view.stats) == {a[0], *b}
