"""ARC: its lists and adaptive target on hand-built sequences, its chain rules and bounds on random traces."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvmesh.cache_policy.arc import ARC, ARCPolicy
from kvmesh.cache_policy.base import LRUPolicy
from kvmesh.cache_policy.policy_cache import PolicyCache
from kvmesh.cache_policy.queue_cache import QueueCache
from kvmesh.cache_policy.registry import get_queue_policy
from kvmesh.sim.run import hit_rate, resolve_names, run_one
from kvmesh.sim.trace import Trace

from tests.policy.queue_replay import chain, replay_checked, replay_tiers_checked, scan_then_reuse
from tests.policy.test_replay_properties import traces


def anything(block: bytes) -> bool:
    return True


def put(a: ARC, name: str) -> bytes | None:
    """A one-block request that misses; the victim."""
    admission = a.insert(name.encode(), anything)
    assert admission.cached
    a.end_request()
    return admission.evicted


def lists(a: ARC) -> tuple[list[str], ...]:
    return tuple([h.decode() for h in lst] for lst in (a.t1, a.t2, a.b1, a.b2))


def test_seen_once_in_t1_seen_twice_in_t2() -> None:
    a = ARC(4)
    put(a, "x")
    assert lists(a) == (["x"], [], [], [])
    a.read(b"x")
    a.end_request()
    assert lists(a) == ([], ["x"], [], [])


def test_ghost_hits_move_the_target_and_land_in_t2() -> None:
    a = ARC(2)
    put(a, "a")
    a.read(b"a")
    a.end_request()
    put(a, "b")
    assert put(a, "c") == b"b"  # |T1| = 1 > p = 0: T1's LRU goes to B1
    assert lists(a) == (["c"], ["a"], ["b"], [])
    assert put(a, "b") == b"a"  # B1 hit: p 0 -> 1, so T1 (1, not above p) keeps c and T2 gives a to B2
    assert a.p == 1.0 and lists(a) == (["c"], ["b"], [], ["a"])
    assert put(a, "a") == b"c"  # B2 hit: p 1 -> 0, T1 is above it again
    assert a.p == 0.0 and lists(a) == ([], ["b", "a"], ["c"], [])


def test_t1_alone_full_drops_its_lru_without_a_ghost() -> None:
    a = ARC(2)
    put(a, "a")
    put(a, "b")
    assert put(a, "c") == b"a"
    assert lists(a) == (["b", "c"], [], [], [])


def test_a_request_is_recorded_leaf_first() -> None:
    cache = QueueCache(ARCPolicy(), 8)
    cache.insert(chain("a", "b", "c"), 0)
    assert list(cache.queues.t1) == [b"c", b"b", b"a"]
    cache.insert(chain("a", "b", "c"), 1)
    assert list(cache.queues.t2) == [b"c", b"b", b"a"] and not cache.queues.t1


def test_a_chain_extended_in_t1_loses_its_new_leaf() -> None:
    cache = QueueCache(ARCPolicy(), 4)
    cache.insert(chain("a", "b"), 0)
    cache.insert(chain("a", "b"), 1)  # a, b in T2
    cache.insert(chain("a", "b", "c", "d"), 2)  # c, d in T1 under b, d the least recent
    r = cache.insert(chain("x"), 3)  # T1 is above p = 0: its leaf goes, not its parent c
    assert r.evicted == [b"d"]
    assert cache.insert(chain("a", "b", "c"), 4).hit_blocks == 3


def test_the_victim_is_the_least_recent_that_may_go() -> None:
    a = ARC(3)
    for n in ("x", "y", "z"):
        put(a, n)
    admission = a.insert(b"w", lambda h: h != b"x")  # x has children, say: y goes
    assert admission.evicted == b"y"
    a.end_request()
    assert lists(a) == (["x", "z", "w"], [], [], [])
    assert not a.insert(b"v", lambda h: False).cached  # nothing may go: not cached, nothing moved
    assert lists(a) == (["x", "z", "w"], [], [], [])


def test_keeps_a_reused_chain_through_a_scan_that_flushes_lru() -> None:
    assert scan_then_reuse(PolicyCache(LRUPolicy(), 10)) == 0
    assert scan_then_reuse(QueueCache(ARCPolicy(), 10)) == 4


def test_sim_runs_it_by_name() -> None:
    assert "arc" in resolve_names(None)
    assert get_queue_policy("arc").name == "arc"
    assert run_one(Trace("t", ()), "arc", 4).policy == "arc"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), capacity=st.integers(0, 12))
def test_list_sizes_stay_within_arcs_bounds(trace: Trace, capacity: int) -> None:
    c = capacity

    def check(a: ARC) -> None:
        t1, t2, b1, b2 = len(a.t1), len(a.t2), len(a.b1), len(a.b2)
        assert t1 + t2 <= c
        assert t1 + b1 <= c
        assert t1 + t2 + b1 + b2 <= 2 * c
        assert 0.0 <= a.p <= c
        keys = [*a.t1, *a.t2, *a.b1, *a.b2]
        assert len(keys) == len(set(keys)), "a key in two lists"

    replay_checked(ARCPolicy(), trace, capacity, check)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), l1=st.integers(0, 8), l2=st.integers(1, 8))
def test_tiers_stay_within_capacity_and_exclusive(trace: Trace, l1: int, l2: int) -> None:
    replay_tiers_checked(ARCPolicy(), trace, l1, l2)


@settings(max_examples=40, deadline=None)
@given(trace=traces(), extra=st.integers(0, 5), fraction=st.floats(0.0, 1.0))
def test_bounded_by_the_ceiling_and_reaches_it_with_room(trace: Trace, extra: int, fraction: float) -> None:
    ceiling = hit_rate(trace, "infinite", 0)
    assert 0.0 <= hit_rate(trace, "arc", round(fraction * trace.unique_blocks)) <= ceiling + 1e-12
    assert hit_rate(trace, "arc", trace.unique_blocks + extra) == ceiling
