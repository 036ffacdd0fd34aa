"""Hit rate over time: the Belady and LRU lines are the sim's on the same records; the page and its PNGs."""

from __future__ import annotations

import pytest
from kvmesh.report.cost_report import ReportOptions, build_report
from kvmesh.report.hit_windows import hit_curve
from kvmesh.report.html import write_html
from kvmesh.report.prices import load_prices
from kvmesh.report.served_trace import as_sim_trace
from kvmesh.sim.run import run_one

from .factory import record


def sessions(n_sessions: int = 6, turns: int = 5) -> list:
    """Interleaved sessions whose prompts grow by two blocks a turn; each session shares its own prefix."""
    out = []
    for turn in range(turns):
        for s in range(n_sessions):
            chain = [1000 * s + k for k in range(2 * (turn + 1))]
            cached = 100 * 2 * turn
            out.append(record(70 * turn + s, 100 * len(chain), hash_ids=chain, session=f"s{s}", cached=cached,
                              worker=f"w{s % 2}", tiers={"l1": cached // 2, "peer": cached - cached // 2}))
    return out


@pytest.mark.parametrize("capacity", [4, 12, 1000])
def test_the_belady_and_lru_lines_are_the_sims_on_the_same_records(capacity: int) -> None:
    records = sessions()
    curve = hit_curve(records, capacity)
    trace = as_sim_trace(records)
    assert curve.totals.belady == pytest.approx(run_one(trace, "belady", capacity).hit_rate)
    assert curve.totals.lru_l1 == pytest.approx(run_one(trace, "lru", capacity).hit_rate)
    assert curve.totals.infinite == pytest.approx(run_one(trace, "infinite", capacity).hit_rate)
    assert curve.totals.lru_l1 <= curve.totals.infinite
    assert sum(w.requests for w in curve.windows) == len(records)


def test_served_hit_rate_is_the_records_own() -> None:
    records = sessions()
    curve = hit_curve(records, 1000, window_s=35)
    blocks = sum(len(r.hash_ids) for r in records)
    assert curve.totals.served == pytest.approx(sum(r.cached_tokens // 100 for r in records) / blocks)
    assert curve.totals.served <= curve.totals.infinite  # the records' hits are real prefix hits
    assert [w.start_s for w in curve.windows] == [0, 70, 140, 210, 280]  # turns 70 s apart: empty windows left out


def test_the_html_page_is_written_with_its_pngs(tmp_path) -> None:
    records = sessions()
    report = build_report(records, load_prices(), ReportOptions(capacity_blocks=8))
    page, hit_png, cost_png = write_html(report, tmp_path / "out" / "cost.html")
    assert page.exists() and hit_png.name == "cost-hit-rate.png" and cost_png.name == "cost-cost.png"
    for png in (hit_png, cost_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    text = page.read_text()
    assert 'src="cost-hit-rate.png"' in text and 'src="cost-cost.png"' in text
    assert f"Recommendation: {report['recommendation']}" in text
