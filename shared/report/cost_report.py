"""One cost report: the measured inputs, every option's cost, hit rate over time, and the recommendation.

`build_report` is pure (records + price book + options -> a JSON-ready
dict); the CLI (shared/cli/report.py) reads the records and prints it, and
shared/report/html.py draws its page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.protocol.traffic import TrafficRecord
from kvmesh.report import decide, hit_windows, hosted, l1_baseline, savings, self_built
from kvmesh.report.measure import measure
from kvmesh.report.prices import PriceBook


@dataclass(frozen=True, slots=True)
class ReportOptions:
    capacity_blocks: int  # the fleet's pooled L1, in blocks of the records' block size (Belady, the baseline's L1)
    gpu_hour_usd: float | None = None  # None: the price file's
    ttft_slo_ms: float | None = None
    hit_rate_target: float | None = None
    window_s: float | None = None  # hit-rate windows (None: ~30 over the span, at least a minute)


def default_capacity(l1_blocks_per_worker: int, workers: int) -> int:
    """The pooled L1 of the fleet that served: one worker's L1 times the workers seen (at least one)."""
    return l1_blocks_per_worker * max(1, workers)


def build_report(records: list[TrafficRecord], book: PriceBook, opts: ReportOptions) -> dict:
    """The report of `records` (at least one) priced by `book`."""
    if not records:
        raise ValueError("no served traffic to report on")
    ordered = sorted(records, key=lambda r: r.at)  # the baseline's replay order
    m = measure(ordered)
    apis = [hosted.hosted_cost(m, p) for p in book.hosted]
    baseline = l1_baseline.lru_l1(ordered, max(1, opts.capacity_blocks))

    def on_gpus(option: str, cached: Sequence[int]) -> self_built.SelfBuiltCost:
        return self_built.gpu_cost(option, ordered, cached, m, book.self_built, opts.gpu_hour_usd)

    no_cache = on_gpus("no_cache", [0] * len(ordered))
    gpus = [on_gpus("self_built", baseline.cached_tokens),
            on_gpus("kvmesh_cross_turn", [r.cached_tokens for r in ordered])]
    per_1m = {c.provider: c.per_1m_tokens_usd for c in apis} | {c.option: c.per_1m_tokens_usd for c in gpus}
    cheapest = min(apis, key=lambda c: c.per_1m_tokens_usd)
    option_costs = {"hosted": cheapest.per_1m_tokens_usd, **{c.option: c.per_1m_tokens_usd for c in gpus}}
    decision = decide.decide(m, book.rules, decide.Inputs(opts.ttft_slo_ms, opts.hit_rate_target, option_costs))
    curve = hit_windows.hit_curve(ordered, opts.capacity_blocks, opts.window_s, baseline)
    return {
        "prices": {"file": book.path, "as_of": book.as_of},
        "measured": m.to_json(),
        "hosted": {"assumption": hosted.ASSUMPTION, "cheapest": cheapest.provider,
                   "apis": [c.to_json() for c in apis]},
        "self_built": {"model": self_built.describe(book.self_built, opts.gpu_hour_usd),
                       "baseline": baseline.to_json(m.tokens_in),
                       "options": [c.to_json() for c in gpus],
                       "no_cache": no_cache.to_json(),
                       "savings": [s.to_json() for s in savings.savings(no_cache, *gpus, m.tokens_in)]},
        "cost_per_1m_tokens_usd": per_1m,
        "hit_rate_over_time": curve.to_json(),
        **decision.to_json(),
    }
