"""The engine's pins within their budgets: per tenant, per pool, the policy's own pins, and expiry."""

from __future__ import annotations

import time

from engine.test_prefix_cache import BS, KEYS, make_cache, run_sequence
from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.cache_policy.pin_ledger import Cap
from kvmesh.engine.pins import PinSet
from kvmesh.protocol.block_hash import hash_blocks


def cached_chain(cache, n: int, seed: int) -> list:
    """`n` blocks computed, cached and released (evictable), as a finished request leaves them."""
    tokens = [(seed * 101 + i) % 997 + 1 for i in range(n * BS)]
    blocks = run_sequence(cache, tokens)
    assert blocks is not None
    cache.release(blocks)
    return hash_blocks(tokens, BS, KEYS)


def test_tenant_cap_refuses_past_it_and_pool_cap_keeps_the_leading_run() -> None:
    cache = make_cache(32)
    pins = PinSet(cache, limit=8, tenant_limit=4)
    a, b, c = cached_chain(cache, 4, 1), cached_chain(cache, 6, 2), cached_chain(cache, 3, 3)
    assert pins.pin_for("t-a", a, until=100, now=0).granted == 4
    over = pins.pin_for("t-a", b[:1], until=100, now=0)
    assert (over.granted, over.refused) == (0, Cap.TENANT)
    assert pins.pin_for("t-b", b, until=100, now=0).granted == 4  # trimmed to t-b's 4: the leading run
    assert pins.pin_for("t-b", b[:4], until=100, now=0).granted == 4  # a refresh; the pool is full: 8 of 8
    full = pins.pin_for("t-c", c, until=100, now=0)
    assert (full.granted, full.refused) == (0, Cap.POOL)
    assert cache.num_evictable == 13 - 8  # 13 blocks cached, 8 of them pinned
    assert pins.pin_for("t-a", a, until=200, now=1).granted == 4  # a refresh is free
    assert pins.expire(100) == 4 and len(pins) == 4  # b's pins end; a's were extended
    assert pins.pin_for("t-c", c, until=300, now=100).granted == 3


def test_policy_pins_are_bound_by_the_pool_only() -> None:
    cache = make_cache(16)
    pins = PinSet(cache, limit=6, tenant_limit=2)
    chain = cached_chain(cache, 8, 5)
    assert pins.pin(chain, until=time.time() + 60) == 6  # tenant "": a session retain, past any tenant's 2


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["t-a", "t-b", ""]), st.integers(0, 3), st.integers(1, 6),
                              st.floats(1, 30), st.floats(0, 10)), max_size=25))
def test_references_follow_the_ledger(ops) -> None:
    """Every pinned block holds exactly one reference; released pins make their blocks evictable again."""
    cache = make_cache(64)
    chains = [cached_chain(cache, 6, s) for s in range(4)]
    pins = PinSet(cache, limit=10, tenant_limit=4)
    now = 0.0
    for tenant, which, n, ttl, step in ops:
        pins.pin_for(tenant, chains[which][:n], now + ttl, now)
        now += step
        pins.expire(now)
        assert len(pins) == len(pins.ledger) <= 10
        assert all(v <= 4 for t, v in pins.ledger.tenants().items() if t)
        assert cache.num_evictable == 24 - len(pins)


def test_l2_budget_from_settings() -> None:
    """A worker's L2 pins: pins.l2_fraction of L2 for the pool, pins.l2_tenant_fraction per tenant, in bytes."""
    from kvmesh.config import PinQuotaSettings
    from kvmesh.serving.pinning import L2Pins

    l2 = L2Pins.for_tier(PinQuotaSettings(l2_fraction=0.5, l2_tenant_fraction=0.2), capacity_bytes=10_000,
                         block_bytes=1_000)
    assert (l2.ledger.pool_cap, l2.ledger.tenant_cap) == (5_000, 2_000)
    hashes = [bytes([i]) * 32 for i in range(4)]
    g = l2.ledger.grant("t-a", hashes, l2.block_bytes, until=10, now=0, trim=True)
    assert (g.granted, g.refused) == (2, Cap.TENANT)  # 4 000 bytes asked, 2 000 allowed: the leading two
