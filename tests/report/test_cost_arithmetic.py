"""The cost arithmetic against a small case computed by hand: three requests, two hosted APIs, one GPU model.

Every expected number below is written out from the prices in `PRICES`
(tests/report/factory.py), not computed by the code under test. The
self-built baseline's own cache is tested in test_l1_baseline.py; here the
GPU costs take the cached tokens per request as given.
"""

from __future__ import annotations

import pytest
from kvmesh.report.hosted import hosted_cost
from kvmesh.report.measure import measure
from kvmesh.report.prices import parse_prices
from kvmesh.report.self_built import gpu_cost

from .factory import PRICES, record

# 3,000 tokens in (1,000 cached; 400 written under 5 min, 200 under 1 h), 350 out, over two minutes.
RECORDS = [
    record(0, 1000, 100, writes={"300": 400}, session="s1"),
    record(30, 1500, 200, cached=1000, writes={"3600": 200}, session="s1"),
    record(90, 500, 50, session="s2"),
]


@pytest.fixture
def book():
    return parse_prices(PRICES)


def test_the_measured_volume_is_the_records_sums() -> None:
    m = measure(RECORDS)
    assert (m.tokens_in, m.tokens_out, m.cached_tokens) == (3000, 350, 1000)
    assert m.cache_write_tokens == {300: 400, 3600: 200}
    assert m.load.minutes == 2 and m.days == 120 / 86400


def test_hosted_with_ttl_write_multipliers(book) -> None:
    a = hosted_cost(measure(RECORDS), book.hosted[0])
    # plain input: 3000 - 1000 cached - 600 written = 1400 tokens x $2
    assert a.input_usd == pytest.approx(1400 * 2.0 / 1e6)
    assert a.cache_read_usd == pytest.approx(1000 * 0.5 / 1e6)
    # 400 x $2 x 1.25 (5 min) + 200 x $2 x 2.0 (1 h)
    assert a.cache_write_usd == pytest.approx((1000 + 800) / 1e6)
    assert a.storage_usd == 0
    assert a.output_usd == pytest.approx(350 * 10.0 / 1e6)
    assert a.total_usd == pytest.approx(0.0086)
    assert a.per_1m_tokens_usd == pytest.approx(0.0086 / 3350 * 1e6)
    assert a.per_day_usd == pytest.approx(0.0086 * 720)  # two minutes are 1/720 of a day


def test_hosted_with_plain_writes_and_storage_per_token_hour(book) -> None:
    b = hosted_cost(measure(RECORDS), book.hosted[1])
    assert b.cache_write_usd == pytest.approx(600 * 1.0 / 1e6)  # no multipliers: writes are plain input
    # 400 tokens for 5 min + 200 tokens for 1 h at $1 per 1M token-hours
    assert b.storage_usd == pytest.approx((400 * 300 / 3600 + 200 * 1.0) / 1e6)
    assert b.total_usd == pytest.approx((1400 + 100 + 600 + 400 / 12 + 200 + 1400) / 1e6)


def test_gpu_cost_prefills_only_what_was_not_cached(book) -> None:
    m = measure(RECORDS)
    # FLOPs(n) = 2 x 1e9 x n + 4 x 2 layers x 4 heads x 8 dims x n^2 / 2 = 2e9 n + 128 n^2, at 0.5 x 1e12 FLOP/s
    flops = {n: 2e9 * n + 128 * n * n for n in (500, 1000, 1500)}
    # peak/mean QPS: the first minute holds 2 of 3 requests over 2 minutes -> (2/60) / (3/120) = 4/3
    assert m.load.peak_to_mean == pytest.approx(4 / 3)

    plain = gpu_cost("no_cache", RECORDS, [0, 0, 0], m, book.self_built)
    assert plain.cached_tokens == 0
    assert plain.prefill_gpu_s == pytest.approx((flops[1000] + flops[1500] + flops[500]) / 0.5e12)
    assert plain.prefill_gpu_s == pytest.approx(12.000896)
    assert plain.decode_gpu_s == pytest.approx(350 / 50)
    assert plain.provisioned_gpu_hours == pytest.approx((12.000896 + 7) * 4 / 3 / 3600)
    assert plain.total_usd == pytest.approx(19.000896 * 4 / 3 / 3600 * 3.6)

    kv = gpu_cost("kvmesh_cross_turn", RECORDS, [r.cached_tokens for r in RECORDS], m, book.self_built)
    assert kv.cached_tokens == 1000
    # the second request prefills tokens 1000..1500 only, attending over the cached 1000
    assert kv.prefill_gpu_s == pytest.approx((flops[1000] + flops[1500] - flops[1000] + flops[500]) / 0.5e12)
    assert kv.prefill_gpu_s == pytest.approx(8.00064)
    assert kv.total_usd == pytest.approx(15.00064 * 4 / 3 / 3600 * 3.6)
    assert kv.per_1m_tokens_usd == pytest.approx(kv.total_usd / 3350 * 1e6)


def test_a_gpu_hour_price_given_on_the_command_line_replaces_the_files(book) -> None:
    m = measure(RECORDS)
    cached = [0, 500, 0]
    assert gpu_cost("self_built", RECORDS, cached, m, book.self_built, gpu_hour_usd=7.2).total_usd == pytest.approx(
        2 * gpu_cost("self_built", RECORDS, cached, m, book.self_built).total_usd)
