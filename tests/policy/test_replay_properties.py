"""Replays of random prefix-sharing traces: the cache's rules hold for every policy.

Only what is guaranteed is asserted: the Belady rule is a heuristic bound
under prefix semantics, so it is compared to ``infinite`` only.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvmesh.cache_policy.policy_cache import BlockSpec, PolicyCache
from kvmesh.cache_policy.registry import POLICIES, get_policy
from kvmesh.sim.run import REFERENCES, hit_rate
from kvmesh.sim.trace import Trace, TraceRequest, block_key

ALL = [*POLICIES, *REFERENCES]


@st.composite
def traces(draw: st.DrawFn, max_requests: int = 25, with_outcomes: bool = False) -> Trace:
    """Requests that extend a random earlier request's prefix with new blocks; `with_outcomes`: each turn's
    tool calls too (unknown, an answer, or a tool call)."""
    n = draw(st.integers(1, max_requests))
    chains: list[tuple[int, ...]] = []
    next_id = 0
    requests = []
    t = 0.0
    for _ in range(n):
        prefix: tuple[int, ...] = ()
        if chains and draw(st.booleans()):
            base = draw(st.sampled_from(chains))
            prefix = base[: draw(st.integers(1, len(base)))]
        tail = draw(st.integers(0 if prefix else 1, 6))
        ids = prefix + tuple(range(next_id, next_id + tail))
        next_id += tail
        chains.append(ids)
        t += draw(st.sampled_from([0.0, 0.5, 3.0, 40.0]))
        tools = draw(st.sampled_from([None, (), ("bash",)])) if with_outcomes else None
        requests.append(TraceRequest(t, 512 * len(ids), 1, tuple(block_key(i) for i in ids), None, tools))
    return Trace("random", tuple(requests))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), capacity=st.integers(0, 12), policy=st.sampled_from(POLICIES), data=st.data())
def test_cache_rules_hold_on_every_request(trace: Trace, capacity: int, policy: str, data: st.DataObject) -> None:
    cache = PolicyCache(get_policy(policy), capacity)
    pins: dict[bytes, float] = {}
    for request in trace.requests:
        now = request.time_s
        pin_until = data.draw(st.sampled_from([0.0, 0.0, now + 5.0]), label="pin")
        specs = [BlockSpec(block_hash=b, pinned_until=pin_until) for b in request.blocks]
        before = set(cache.blocks)
        result = cache.insert(specs, now)
        for b in request.blocks:
            if b in cache.blocks:
                pins[b] = max(pins.get(b, 0.0), cache.blocks[b].pinned_until)
        evicted = set(result.evicted)
        assert len(cache) <= capacity
        assert evicted <= before
        assert not evicted & set(request.blocks), "evicted a block of the in-flight request"
        assert all(pins.get(b, 0.0) <= now for b in evicted), "evicted a pinned block"
        for info in cache.blocks.values():  # leaf-first: no orphans, children counted
            assert info.parent_hash is None or info.parent_hash in cache.blocks
        children = {h: 0 for h in cache.blocks}
        for info in cache.blocks.values():
            if info.parent_hash is not None:
                children[info.parent_hash] += 1
        assert all(cache.blocks[h].num_children == c for h, c in children.items())
        assert cache.match_prefix(list(request.blocks)) == result.hit_blocks + result.inserted


@settings(max_examples=40, deadline=None)
@given(trace=traces(), fraction=st.floats(0.0, 1.0))
def test_infinite_bounds_every_policy(trace: Trace, fraction: float) -> None:
    capacity = round(fraction * trace.unique_blocks)
    ceiling = hit_rate(trace, "infinite", capacity)
    for name in ALL:
        assert 0.0 <= hit_rate(trace, name, capacity) <= ceiling + 1e-12, name


@settings(max_examples=40, deadline=None)
@given(trace=traces(), extra=st.integers(0, 5))
def test_room_for_everything_reaches_the_ceiling(trace: Trace, extra: int) -> None:
    capacity = trace.unique_blocks + extra
    ceiling = hit_rate(trace, "infinite", capacity)
    for name in ["default", "lru", "lfu", "session", "continuum", "belady"]:
        assert hit_rate(trace, name, capacity) == ceiling, name
    # admission refuses first requests, so it can only lose hits
    assert hit_rate(trace, "tinylfu", capacity) <= ceiling


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), capacity=st.integers(0, 12), data=st.data())
def test_default_refuses_only_displacements(trace: Trace, capacity: int, data: st.DataObject) -> None:
    """The default's gate: free room and pinned blocks are never refused; it refuses evictions only."""
    cache = PolicyCache(get_policy("default"), capacity)
    for request in trace.requests:
        now = request.time_s
        pin_until = data.draw(st.sampled_from([0.0, now + 5.0]), label="pin")
        result = cache.insert([BlockSpec(block_hash=b, pinned_until=pin_until) for b in request.blocks], now)
        if not result.rejected:
            continue
        assert len(cache) == capacity, "refused a block while there was room"
        if pin_until > now:  # a pinned block is refused only when nothing else may go
            others = [i for i in cache.evictable(now) if i.block_hash not in request.blocks]
            assert not others, "refused a pinned block although a leaf could be evicted"
