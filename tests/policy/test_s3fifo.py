"""S3-FIFO: its queues on hand-built sequences, its chain rules and bounds on random traces."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvmesh.cache_policy.base import LRUPolicy
from kvmesh.cache_policy.policy_cache import PolicyCache
from kvmesh.cache_policy.queue_cache import QueueCache
from kvmesh.cache_policy.registry import get_queue_policy
from kvmesh.cache_policy.s3fifo import MAX_FREQ, S3FIFO, S3FIFOPolicy
from kvmesh.sim.run import hit_rate, resolve_names, run_one
from kvmesh.sim.trace import Trace

from tests.policy.queue_replay import chain, replay_checked, replay_tiers_checked, scan_then_reuse
from tests.policy.test_replay_properties import traces


def anything(block: bytes) -> bool:
    return True


def fill(s: S3FIFO, *names: str) -> list[bytes | None]:
    """Insert one-block requests; the victims, in order."""
    out = []
    for n in names:
        admission = s.insert(n.encode(), anything)
        assert admission.cached
        s.end_request()
        out.append(admission.evicted)
    return out


def test_shares_and_ghost_size() -> None:
    s = S3FIFO(100)
    assert (s.small_share, s.ghost_capacity) == (10, 90)
    assert S3FIFO(4).small_share == 1  # never an empty small queue


def test_a_block_read_in_small_moves_to_main_and_an_unread_one_becomes_a_ghost() -> None:
    s = S3FIFO(4)
    fill(s, "a", "b", "c", "d")
    for n in (b"a", b"b", b"c"):
        s.read(n)
    assert fill(s, "e") == [b"d"]  # a, b, c were read: to main, counts cleared; d was not
    assert dict(s.main) == {b"a": 0, b"b": 0, b"c": 0}
    assert list(s.small) == [b"e"] and list(s.ghost) == [b"d"]


def test_a_ghost_hit_goes_to_main_and_main_reinserts_while_its_count_lasts() -> None:
    s = S3FIFO(4)
    fill(s, "a", "b", "c", "d")
    for n in (b"a", b"b", b"c"):
        s.read(n)
    fill(s, "e")
    assert fill(s, "d") == [b"e"]  # d is a ghost: room from small (e), then d enters main
    assert list(s.main) == [b"a", b"b", b"c", b"d"] and not s.small
    for n in (b"a", b"a", b"b"):
        s.read(n)
    assert fill(s, "x") == [b"c"]  # a (2) and b (1) go round once more, c (0) is evicted
    assert list(s.main.items()) == [(b"d", 0), (b"a", 1), (b"b", 0)]


def test_frequency_is_capped_at_two_bits() -> None:
    s = S3FIFO(4)
    fill(s, "a")
    for _ in range(10):
        s.read(b"a")
    assert s.small[b"a"] == MAX_FREQ == 3


def test_a_block_that_may_not_go_keeps_its_place() -> None:
    s = S3FIFO(3)
    fill(s, "a", "b", "c")
    admission = s.insert(b"d", lambda h: h != b"a")  # a has children, say: b goes
    s.end_request()
    assert admission.evicted == b"b" and list(s.small) == [b"a", b"c", b"d"]
    assert fill(s, "e") == [b"a"]  # now it may: first in line again
    assert not s.insert(b"f", lambda h: False).cached
    assert list(s.small) == [b"c", b"d", b"e"]


def test_a_fresh_chain_drains_leaf_to_root() -> None:
    cache = QueueCache(S3FIFOPolicy(), 4)
    cache.insert(chain("a", "b", "c"), 0)
    cache.insert(chain("x"), 1)
    assert cache.insert(chain("y"), 2).evicted == [b"c"]
    assert cache.insert(chain("z"), 3).evicted == [b"b"]


def test_a_request_never_evicts_its_own_blocks() -> None:
    cache = QueueCache(S3FIFOPolicy(), 3)
    r = cache.insert(chain("a", "b", "c", "d", "e"), 0)
    assert (r.inserted, r.rejected, r.evicted) == (3, 2, [])
    r = cache.insert(chain("a", "x", "y"), 1)
    assert r.hit_blocks == 1 and r.evicted == [b"c", b"b"]


def test_keeps_a_reused_chain_through_a_scan_that_flushes_lru() -> None:
    assert scan_then_reuse(PolicyCache(LRUPolicy(), 10)) == 0
    assert scan_then_reuse(QueueCache(S3FIFOPolicy(), 10)) == 4


def test_sim_runs_it_by_name() -> None:
    assert "s3fifo" in resolve_names(None)
    assert get_queue_policy("s3fifo").name == "s3fifo"
    trace = Trace("t", ())
    assert run_one(trace, "s3fifo", 4).policy == "s3fifo"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), capacity=st.integers(0, 12))
def test_queues_and_ghost_stay_bounded(trace: Trace, capacity: int) -> None:
    def check(s: S3FIFO) -> None:
        assert len(s.small) + len(s.main) <= capacity
        assert len(s.ghost) <= s.ghost_capacity < max(capacity, 1)
        assert not (s.small.keys() & s.main.keys()) and not (s.ghost.keys() & (s.small.keys() | s.main.keys()))
        assert all(0 <= f <= MAX_FREQ for f in (*s.small.values(), *s.main.values()))

    replay_checked(S3FIFOPolicy(), trace, capacity, check)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), l1=st.integers(0, 8), l2=st.integers(1, 8))
def test_tiers_stay_within_capacity_and_exclusive(trace: Trace, l1: int, l2: int) -> None:
    replay_tiers_checked(S3FIFOPolicy(), trace, l1, l2)


@settings(max_examples=40, deadline=None)
@given(trace=traces(), extra=st.integers(0, 5), fraction=st.floats(0.0, 1.0))
def test_bounded_by_the_ceiling_and_reaches_it_with_room(trace: Trace, extra: int, fraction: float) -> None:
    ceiling = hit_rate(trace, "infinite", 0)
    assert 0.0 <= hit_rate(trace, "s3fifo", round(fraction * trace.unique_blocks)) <= ceiling + 1e-12
    assert hit_rate(trace, "s3fifo", trace.unique_blocks + extra) == ceiling
