"""The pin ledger's caps hold under any order of grants, extensions, releases and expiries (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.cache_policy.pin_ledger import Cap, PinLedger

TENANTS = ["a", "b", "c", ""]  # "": the system's own pins, bound by the pool cap only
SIZE = 10


def _hashes(tenant: str, start: int, n: int) -> list[bytes]:
    return [f"{tenant}-{i}".encode() for i in range(start, start + n)]


op = st.one_of(
    st.tuples(st.just("grant"), st.sampled_from(TENANTS), st.integers(0, 12), st.integers(1, 8),
              st.floats(1, 50), st.booleans(), st.booleans()),
    st.tuples(st.just("release"), st.sampled_from(TENANTS), st.integers(0, 12), st.integers(1, 8)),
    st.tuples(st.just("tick"), st.floats(0, 20)),
)


def _check(ledger: PinLedger, now: float) -> None:
    tenants = ledger.tenants()
    assert sum(tenants.values()) == ledger.used()
    if ledger.pool_cap is not None:
        assert ledger.used() <= ledger.pool_cap
    if ledger.tenant_cap is not None:
        assert all(v <= ledger.tenant_cap for t, v in tenants.items() if t)
    assert ledger.used() == SIZE * len(ledger)
    ledger.expire(now)
    assert all(ledger.until(h) > now for h in list(ledger._pins))


@settings(max_examples=300, deadline=None)
@given(pool=st.one_of(st.none(), st.integers(0, 200)), tenant=st.one_of(st.none(), st.integers(0, 120)),
       ops=st.lists(op, max_size=60))
def test_caps_hold_under_any_history(pool, tenant, ops) -> None:
    ledger = PinLedger(pool, tenant)
    now = 0.0
    for o in ops:
        if o[0] == "grant":
            _, t, start, n, ttl, whole, trim = o
            before = ledger.used(), ledger.tenant_used(t)
            g = ledger.grant(t, _hashes(t, start, n), SIZE, now + ttl, now, whole=whole, trim=trim)
            assert g.granted <= n
            if (g.refused is Cap.TENANT and not trim) or (whole and g.refused is not None):
                assert g.granted == 0 and (ledger.used(), ledger.tenant_used(t)) == before
            assert ledger.used() == before[0] + g.new_bytes
        elif o[0] == "release":
            _, t, start, n = o
            ledger.release(_hashes(t, start, n), t)
        else:
            now += o[1]
        _check(ledger, now)


def test_extension_is_free_and_expiry_frees_the_tenant() -> None:
    ledger = PinLedger(pool_cap=100, tenant_cap=30)
    a = _hashes("a", 0, 3)
    assert ledger.grant("a", a, SIZE, until=10, now=0).granted == 3
    again = ledger.grant("a", a, SIZE, until=20, now=1)
    assert again.granted == 3 and again.new_bytes == 0 and ledger.until(a[0]) == 20
    over = ledger.grant("a", _hashes("a", 3, 1), SIZE, until=20, now=2)
    assert over.refused is Cap.TENANT and over.granted == 0 and over.wanted_bytes == SIZE
    assert ledger.expire(10) == []  # extended to 20: the first deadline no longer counts
    assert sorted(ledger.expire(20)) == sorted(a) and ledger.tenant_used("a") == 0
    assert ledger.grant("a", _hashes("a", 3, 3), SIZE, until=30, now=21).granted == 3


def test_trim_keeps_the_leading_run_under_the_tenant_cap() -> None:
    ledger = PinLedger(pool_cap=None, tenant_cap=25)
    g = ledger.grant("a", _hashes("a", 0, 4), SIZE, until=10, now=0, trim=True)
    assert (g.granted, g.refused, ledger.tenant_used("a")) == (2, Cap.TENANT, 2 * SIZE)


def test_full_pool_grants_the_leading_run_or_nothing_when_whole() -> None:
    ledger = PinLedger(pool_cap=50, tenant_cap=None)
    assert ledger.grant("a", _hashes("a", 0, 4), SIZE, until=10, now=0).granted == 4
    part = ledger.grant("b", _hashes("b", 0, 3), SIZE, until=10, now=0)
    assert (part.granted, part.refused) == (1, Cap.POOL)
    whole = ledger.grant("c", _hashes("c", 0, 2), SIZE, until=10, now=0, whole=True)
    assert (whole.granted, whole.refused, ledger.tenant_used("c")) == (0, Cap.POOL, 0)
