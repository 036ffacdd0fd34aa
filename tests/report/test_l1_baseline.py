"""The self-built baseline (one engine, LRU prefix caching in an L1 of 3 blocks) on five requests, by hand.

Blocks of 100 tokens; ids name blocks, equal ids a shared prefix. The GPU
model is factory.PRICES: FLOPs(n) = 2e9 n + 128 n^2 at 0.5e12 FLOP/s,
decode 50 tokens/s, $3.6 per GPU-hour ($0.001 per GPU-second). Every request
has 10 output tokens and all arrive in one minute (peak/mean 1, 1/1440 day).

    t   prompt  blocks     LRU L1 before -> hit   L1 after   baseline reuses   kvmesh served
    0   250     1 2        {}            -> 0     {1 2}      0                 0
    10  350     1 2 3      {1 2}         -> 2     {1 2 3}    200               300 (block 3: its last answer)
    20  250     4 5        {1 2 3}       -> 0     {1 4 5}    0                 0
    30  450     1 2 3 6    {1 4 5}       -> 1     {1 2 3}    100               300 (2 and 3 from L2)
    40  300     1 2 3      {1 2 3}       -> 3     {1 2 3}    200               200

At t=20 the leaves go first, oldest first: 3, then 2 (4 is the request's
own). At t=30 block 2 evicts 5, block 3 evicts 4, and 6 finds no room (every
leaf is the request's own). At t=40 all three blocks hit, but an engine
always computes the last prompt token: (300 - 1) // 100 = 2 blocks reused.
Hits: 6 blocks of 14 (`kvmesh sim --policy lru` counts the same), 500 tokens.

Block 3 at t=10 was in no earlier prompt (an infinite cache's hit is 2
blocks), so kvmesh's hits hold 100 answer-block tokens the baseline cannot see.

Prefill GPU-seconds, with F(250) = 500.008e9, F(350) = 700.01568e9, F(450) = 900.02592e9,
F(300) = 600.01152e9, F(200) = 400.00512e9, F(100) = 200.00128e9 FLOPs:

    no cache  = sum F(prompt)                         = 3,200.06912e9 / 0.5e12 = 6.40013824 s
    baseline  = no cache - F(200) - F(100) - F(200)   = 2,200.0576e9  / 0.5e12 = 4.4001152 s
    kvmesh    = no cache - F(300) - F(300) - F(200)   = 1,600.04096e9 / 0.5e12 = 3.20008192 s

    l1_prefix_caching = 6.40013824 - 4.4001152  = 2.00002304 s, $0.00200002304, 500 tokens (500/1600 of the prompts)
    kvmesh_on_top     = 4.4001152  - 3.20008192 = 1.20003328 s, $0.00120003328, 300 tokens (300/1600)

Totals add the 1 s of decode (50 tokens / 50 per s): baseline $0.0054001152, kvmesh $0.00420008192.
"""

from __future__ import annotations

import pytest
from kvmesh.report.cost_report import ReportOptions, build_report
from kvmesh.report.l1_baseline import lru_l1
from kvmesh.report.prices import parse_prices
from kvmesh.report.served_trace import as_sim_trace
from kvmesh.sim.run import run_one

from .factory import PRICES, record

RECORDS = [
    record(0, 250, hash_ids=[1, 2]),
    record(10, 350, hash_ids=[1, 2, 3], cached=300),
    record(20, 250, hash_ids=[4, 5]),
    record(30, 450, hash_ids=[1, 2, 3, 6], cached=300, tiers={"l1": 100, "l2": 200}),
    record(40, 300, hash_ids=[1, 2, 3], cached=200),
]


def test_lru_hits_per_request_as_computed_by_hand() -> None:
    base = lru_l1(list(reversed(RECORDS)), capacity_blocks=3)  # any order in: arrival order out
    assert base.hit_blocks == (0, 2, 0, 1, 3)
    assert base.cached_tokens == (0, 200, 0, 100, 200)
    assert base.seen_blocks == (0, 2, 0, 3, 3)
    assert (base.input_blocks, base.answer_block_tokens) == (14, 100)
    assert base.total_hit_blocks == run_one(as_sim_trace(RECORDS), "lru", 3).l1_hit_blocks == 6


def test_the_report_splits_l1_prefix_caching_from_what_kvmesh_adds() -> None:
    report = build_report(RECORDS, parse_prices(PRICES), ReportOptions(capacity_blocks=3))
    built = report["self_built"]
    assert built["baseline"]["cached_tokens"] == 500 and built["baseline"]["l1_capacity_blocks"] == 3

    no_cache = built["no_cache"]
    baseline, kvmesh = built["options"]
    assert (baseline["option"], kvmesh["option"]) == ("self_built", "kvmesh_cross_turn")
    assert no_cache["prefill_gpu_s"] == pytest.approx(6.40013824)
    assert baseline["prefill_gpu_s"] == pytest.approx(4.4001152)
    assert kvmesh["prefill_gpu_s"] == pytest.approx(3.20008192)
    assert baseline["total_usd"] == pytest.approx(0.0054001152)
    assert kvmesh["total_usd"] == pytest.approx(0.00420008192)
    assert report["cost_per_1m_tokens_usd"]["self_built"] == pytest.approx(0.0054001152 / 1650 * 1e6)

    l1, on_top = built["savings"]
    assert l1["source"] == "l1_prefix_caching"
    assert (l1["cached_tokens"], l1["hit_rate"]) == (500, 500 / 1600)
    assert l1["prefill_gpu_s"] == pytest.approx(2.00002304)
    assert l1["usd"] == pytest.approx(0.00200002304)
    assert l1["per_day_usd"] == pytest.approx(0.00200002304 * 1440)
    assert on_top["source"] == "kvmesh_on_top"
    assert (on_top["cached_tokens"], on_top["hit_rate"]) == (300, 300 / 1600)
    assert on_top["prefill_gpu_s"] == pytest.approx(1.20003328)
    assert on_top["usd"] == pytest.approx(0.00120003328)
    assert on_top["per_1m_tokens_usd"] == pytest.approx(0.00120003328 / 1650 * 1e6)
    assert built["baseline"]["answer_block_tokens"] == 100

    totals = report["hit_rate_over_time"]["totals"]
    assert totals["lru_l1"] == pytest.approx(6 / 14) and totals["infinite"] == pytest.approx(8 / 14)
