"""The measure step: load profile per minute, turns per session, tier hit rates, cache writes by TTL."""

from __future__ import annotations

import pytest
from kvmesh.report.measure import load_profile, measure

from .factory import T0, record


def test_peak_to_mean_counts_empty_minutes() -> None:
    # 6 arrivals in minute 0, none in minutes 1-2, 2 in minute 3: 4 minutes, 8 requests
    arrivals = [T0 + s for s in (0, 5, 10, 20, 40, 59)] + [T0 + 180, T0 + 239]
    load = load_profile(arrivals)
    assert load.minutes == 4
    assert load.mean_qps == pytest.approx(8 / 240)
    assert load.peak_qps == pytest.approx(6 / 60)
    assert load.peak_to_mean == pytest.approx(3.0)
    assert load.requests_per_day == pytest.approx(8 / 240 * 86400)


def test_a_single_request_is_one_minute_of_traffic() -> None:
    load = load_profile([T0])
    assert (load.minutes, load.peak_to_mean, load.requests_per_day) == (1, 1.0, 1440)


def test_turns_per_session_and_unsessioned_requests() -> None:
    turns = {"a": 1, "b": 2, "c": 3, "d": 7}
    records = [record(i, 200, session=s) for s, n in turns.items() for i in range(n)]
    records += [record(1, 200), record(2, 200)]
    m = measure(records)
    assert (m.sessions, m.unsessioned) == (4, 2)
    assert m.turns.mean == pytest.approx(13 / 4)
    assert m.turns.p50 == 2  # nearest rank: the 2nd of 4
    assert m.turns.p90 == 7  # the 4th of 4


def test_tier_hit_rates_and_writes_by_ttl() -> None:
    records = [
        record(0, 1000, cached=600, tiers={"l1": 100, "l2": 200, "peer": 100, "l3": 200}, writes={"300": 50}),
        record(1, 1000, cached=400, writes={"300": 10, "86400": 500}),  # no tiers said: all l1
    ]
    m = measure(records)
    assert m.tier_tokens == {"l1": 500, "l2": 200, "peer": 100, "l3": 200}
    assert sum(m.tier_tokens.values()) == m.cached_tokens
    assert m.tier_hit_rates == pytest.approx({"l1": 0.25, "l2": 0.1, "peer": 0.05, "l3": 0.1})
    assert m.hit_rate == pytest.approx(0.5)
    assert m.cache_write_tokens == {300: 60, 86400: 500}


def test_workers_count_only_named_ones() -> None:
    m = measure([record(0, 100, worker="w0"), record(1, 100, worker="w1"), record(2, 100, worker="")])
    assert m.workers == 2
