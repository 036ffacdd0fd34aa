"""PolicyCache rules on hand-built chains: capacity, leaf-first, pins, in-flight blocks."""

from __future__ import annotations

from kvmesh.cache_policy.base import LRUPolicy
from kvmesh.cache_policy.policy_cache import BlockSpec, PolicyCache
from kvmesh.cache_policy.registry import get_policy
from kvmesh.cache_policy.tinylfu import TinyLFUPolicy


def chain(*names: str, pin: float = 0.0) -> list[BlockSpec]:
    return [BlockSpec(block_hash=n.encode(), pinned_until=pin) for n in names]


def cached(cache: PolicyCache) -> set[str]:
    return {h.decode() for h in cache.blocks}


def test_prefix_hit_counts_leading_blocks_only() -> None:
    cache = PolicyCache(LRUPolicy(), 10)
    assert cache.insert(chain("a", "b", "c"), 0).hit_blocks == 0
    r = cache.insert(chain("a", "b", "x", "y"), 1)
    assert (r.hit_blocks, r.inserted) == (2, 2)
    assert cache.blocks[b"b"].num_children == 2
    assert cache.blocks[b"a"].access_count == 2


def test_leaves_go_before_their_parents() -> None:
    cache = PolicyCache(LRUPolicy(), 4)
    cache.insert(chain("a", "b", "c"), 0)  # a is the oldest but has children
    cache.insert(chain("x"), 1)
    r = cache.insert(chain("y"), 2)
    assert r.evicted == [b"c"]  # the leaf, not the older root
    r = cache.insert(chain("z"), 3)
    assert r.evicted == [b"b"]  # b became a leaf when c left


def test_in_flight_blocks_are_never_evicted_and_capacity_holds() -> None:
    cache = PolicyCache(LRUPolicy(), 3)
    r = cache.insert(chain("a", "b", "c", "d", "e"), 0)
    assert r.inserted == 3 and r.rejected == 2 and r.evicted == []
    assert cached(cache) == {"a", "b", "c"}
    # a new request evicts the old chain from its tail, never its own prefix
    r = cache.insert(chain("a", "x", "y"), 1)
    assert r.hit_blocks == 1 and r.evicted == [b"c", b"b"]
    assert cached(cache) == {"a", "x", "y"}


def test_pinned_blocks_stay_until_their_pin_expires() -> None:
    cache = PolicyCache(LRUPolicy(), 2)
    cache.insert(chain("p", pin=10.0), 0)
    cache.insert(chain("q"), 1)
    r = cache.insert(chain("r"), 2)
    assert r.evicted == [b"q"]  # p is older but pinned
    r = cache.insert(chain("s"), 11)  # the pin has expired: p is the oldest
    assert r.evicted == [b"p"]


def test_pin_extension_and_nothing_evictable() -> None:
    cache = PolicyCache(LRUPolicy(), 1)
    cache.insert(chain("p", pin=5.0), 0)
    cache.pin(b"p", 20.0)
    r = cache.insert(chain("q"), 10)
    assert (r.inserted, r.rejected, r.evicted) == (0, 1, [])
    assert cached(cache) == {"p"}
    assert list(cache.evictable(10)) == []
    assert cache.insert(chain("q"), 21).evicted == [b"p"]


def test_admission_refusal_stops_the_chain() -> None:
    cache = PolicyCache(TinyLFUPolicy(), 10)
    r = cache.insert(chain("a", "b"), 0)
    assert (r.inserted, r.rejected) == (0, 2)
    r = cache.insert(chain("a", "b", "c"), 1)  # a, b seen before; c is new
    assert (r.hit_blocks, r.inserted, r.rejected) == (0, 2, 1)
    assert cache.insert(chain("a", "b", "c"), 2).hit_blocks == 2


def test_zero_capacity_caches_nothing() -> None:
    cache = PolicyCache(get_policy("cost"), 0)
    assert cache.insert(chain("a", "b"), 0).inserted == 0
    assert len(cache) == 0


def test_a_chain_that_repeats_a_hash_stops_there() -> None:
    cache = PolicyCache(LRUPolicy(), 10)
    r = cache.insert(chain("a", "b", "a", "c"), 0)
    assert (r.inserted, r.rejected) == (2, 2)
    assert cache.blocks[b"a"].num_children == 1


def test_cost_fills_free_room_but_guards_evictions() -> None:
    cache = PolicyCache(get_policy("cost"), 2)
    assert cache.insert(chain("a"), 0).inserted == 1  # first request, free room: cached
    cache.insert(chain("b"), 1)
    r = cache.insert(chain("c"), 2)  # first request of c, cache full: a and b stay
    assert (r.inserted, r.rejected, cached(cache)) == (0, 1, {"a", "b"})
    r = cache.insert(chain("c"), 3)  # c seen before: it may displace
    assert (r.inserted, len(r.evicted)) == (1, 1)
    r = cache.insert(chain("p", pin=10.0), 4)  # pinned: cached on its first request
    assert r.inserted == 1 and "p" in cached(cache)


def test_touch_outside_insert_refreshes_the_rank() -> None:
    cache = PolicyCache(LRUPolicy(), 2)
    cache.insert(chain("a"), 0)
    cache.insert(chain("b"), 1)
    assert cache.touch(b"a", 2) and not cache.touch(b"zz", 2)
    assert cache.blocks[b"a"].last_access == 2
    assert cache.insert(chain("c"), 3).evicted == [b"b"]  # a was read at 2: b is now the oldest
