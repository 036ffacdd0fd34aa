"""Each decision rule's branch, on measured numbers from hand-made records."""

from __future__ import annotations

from kvmesh.report.decide import Inputs, decide
from kvmesh.report.measure import measure
from kvmesh.report.prices import load_prices

from .factory import record

RULES = load_prices().rules  # the shipped thresholds: peak/mean 3, 100k and 1M requests/day, 5 turns


def test_volatile_small_latency_tolerant_traffic_goes_hosted() -> None:
    # ten requests in the first minute, one in the tenth: peak/mean 10/60 / (11/600) = 9.1
    records = [record(i, 1000) for i in range(10)] + [record(560, 1000)]
    d = decide(measure(records), RULES, Inputs(cost_per_1m={"hosted": 1.0, "self_built": 2.0, "kvmesh_cross_turn": 2.0}))
    assert d.recommendation == "hosted"
    hosted = d.rules[0]
    assert [c.holds for c in hosted.checks] == [True, True, True]
    assert any("volatile load" in r and "-> yes" in r for r in d.reasons)


def test_a_strict_ttft_slo_is_not_latency_tolerant() -> None:
    records = [record(i, 1000) for i in range(10)] + [record(560, 1000)]
    d = decide(measure(records), RULES, Inputs(ttft_slo_ms=200))
    assert [c.holds for c in d.rules[0].checks] == [True, False, True]


def test_stable_volume_past_a_million_a_day_goes_self_built() -> None:
    # 1,400 requests evenly over two minutes: 1,008,000 a day, peak/mean 1
    records = [record(i * 120 / 1400, 1000) for i in range(1400)]
    m = measure(records)
    assert m.load.requests_per_day >= 1_000_000 and m.load.peak_to_mean < 1.01
    d = decide(m, RULES, Inputs(cost_per_1m={"hosted": 1.0, "self_built": 0.2, "kvmesh_cross_turn": 0.3}))
    assert d.recommendation == "self_built"
    assert [c.holds for c in d.rules[1].checks] == [True, True, True]


def test_self_built_pricier_than_hosted_fails_its_cost_check() -> None:
    records = [record(i * 120 / 1400, 1000) for i in range(1400)]
    d = decide(measure(records), RULES, Inputs(cost_per_1m={"hosted": 0.1, "self_built": 0.2}))
    assert [c.holds for c in d.rules[1].checks] == [True, True, False]


def test_long_sessions_shared_across_workers_and_a_hit_rate_need_go_cross_turn() -> None:
    records = []
    for s in range(4):  # four sessions of 8 turns, alternating workers, half of the hits from the peer
        for turn in range(8):
            cached = 100 * turn
            records.append(record(s * 10 + turn, 100 * (turn + 1), session=f"s{s}", worker=f"w{turn % 2}",
                                  cached=cached, tiers={"l1": cached // 2, "peer": cached - cached // 2}))
    d = decide(measure(records), RULES, Inputs(hit_rate_target=0.8))
    assert d.recommendation == "kvmesh_cross_turn"
    assert [c.holds for c in d.rules[2].checks] == [True, True, True]
    assert any("peers or L3" in r for r in d.reasons)


def test_several_workers_without_shared_hits_do_not_count_as_sharing() -> None:
    records = [record(i, 1000, worker=f"w{i % 3}", cached=500, session="s") for i in range(8)]
    d = decide(measure(records), RULES, Inputs())
    assert [c.holds for c in d.rules[2].checks] == [True, False, False]


def test_a_tie_goes_to_the_option_cheaper_per_million_tokens() -> None:
    # one request: peak/mean 1 (stable, not volatile), 1,440/day (small), no sessions, no target.
    # hosted: tolerant + small = 2/3; self-built: stable + cheaper = 2/3; cross-turn 0/3
    m = measure([record(0, 1000)])
    cheap_gpu = decide(m, RULES, Inputs(cost_per_1m={"hosted": 1.0, "self_built": 0.5}))
    assert cheap_gpu.rules[0].score == cheap_gpu.rules[1].score == 2 / 3
    assert cheap_gpu.recommendation == "self_built"
    # priced above hosted, self-built loses its cost check and hosted wins outright
    assert decide(m, RULES, Inputs(cost_per_1m={"hosted": 1.0, "self_built": 2.0})).recommendation == "hosted"
