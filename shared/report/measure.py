"""From served-traffic records to the report's measured inputs: volume, caching, sessions, load, tiers.

Definitions (docs/cost-report.md has them with examples):
- the window is whole minutes from the first arrival: `minutes = floor((last - first) / 60) + 1`,
  so one request is one minute and a recording never extrapolates from less than a minute;
- QPS is counted per minute of that window (empty minutes count as 0): mean = requests / (60 x minutes),
  peak = the busiest minute / 60, and `peak_to_mean` their ratio;
- requests per day = requests / (60 x minutes) x 86,400;
- turns per session over the records with a session id; `unsessioned` counts the others;
- tier hit rates are tier tokens over prompt tokens; a record whose worker did not say puts all of its
  cached tokens in l1 (the contract's rule).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

from kvmesh.protocol.traffic import TIERS, TrafficRecord

WINDOW_S = 60.0
DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class Spread:
    """Mean and percentiles (nearest rank) of a sample; zeros when empty."""

    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            return cls()
        xs = sorted(values)
        return cls(sum(xs) / len(xs), percentile(xs, 0.5), percentile(xs, 0.9))


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q of the sample at or below it."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return float(sorted_values[rank - 1])


@dataclass(frozen=True, slots=True)
class Load:
    minutes: int
    mean_qps: float
    peak_qps: float
    peak_to_mean: float
    requests_per_day: float


@dataclass(frozen=True, slots=True)
class Measured:
    requests: int
    tokens_in: int
    tokens_out: int
    cached_tokens: int
    cache_write_tokens: dict[int, int]  # TTL seconds -> prompt tokens written under it
    tier_tokens: dict[str, int]  # l1 / l2 / peer / l3 -> cached tokens from there
    sessions: int
    unsessioned: int
    turns: Spread
    load: Load
    workers: int  # distinct prefill workers that served (unknown ones not counted)
    tenants: int
    ttft_ms: Spread
    first_at: float = 0.0
    last_at: float = 0.0
    apis: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.tokens_in if self.tokens_in else 0.0

    @property
    def tier_hit_rates(self) -> dict[str, float]:
        return {t: (n / self.tokens_in if self.tokens_in else 0.0) for t, n in self.tier_tokens.items()}

    @property
    def cache_write_total(self) -> int:
        return sum(self.cache_write_tokens.values())

    @property
    def days(self) -> float:
        return self.load.minutes * WINDOW_S / DAY_S

    def to_json(self) -> dict:
        out = asdict(self)
        out["cache_write_tokens"] = {str(k): v for k, v in sorted(self.cache_write_tokens.items())}
        out["hit_rate"] = self.hit_rate
        out["tier_hit_rates"] = self.tier_hit_rates
        return out


def load_profile(arrivals: list[float]) -> Load:
    """Per-minute QPS of the arrivals (unix seconds) over whole minutes from the first one."""
    if not arrivals:
        return Load(0, 0.0, 0.0, 0.0, 0.0)
    first = min(arrivals)
    per_minute = Counter(int((t - first) // WINDOW_S) for t in arrivals)
    minutes = max(per_minute) + 1
    mean = len(arrivals) / (minutes * WINDOW_S)
    peak = max(per_minute.values()) / WINDOW_S
    return Load(minutes, mean, peak, peak / mean, mean * DAY_S)


def record_tiers(record: TrafficRecord) -> dict[str, int]:
    """Where a record's cached tokens came from (all l1 when the worker did not say)."""
    if not record.tier_tokens:
        return {"l1": record.cached_tokens}
    return record.tier_tokens


def measure(records: list[TrafficRecord]) -> Measured:
    """The measured inputs of the report over `records` (any order)."""
    writes: Counter[int] = Counter()
    tiers: Counter[str] = Counter({t: 0 for t in TIERS})
    turns: Counter[str] = Counter()
    for r in records:
        for ttl, n in r.cache_write_tokens.items():
            writes[int(ttl)] += n
        tiers.update(record_tiers(r))
        if r.session_id is not None:
            turns[r.session_id] += 1
    arrivals = [r.at for r in records]
    return Measured(
        requests=len(records),
        tokens_in=sum(r.input_length for r in records),
        tokens_out=sum(r.output_length for r in records),
        cached_tokens=sum(r.cached_tokens for r in records),
        cache_write_tokens=dict(writes),
        tier_tokens=dict(tiers),
        sessions=len(turns),
        unsessioned=sum(1 for r in records if r.session_id is None),
        turns=Spread.of([float(n) for n in turns.values()]),
        load=load_profile(arrivals),
        workers=len({r.worker for r in records if r.worker}),
        tenants=len({r.tenant for r in records}),
        ttft_ms=Spread.of([r.ttft_ms for r in records if r.ttft_ms is not None]),
        first_at=min(arrivals, default=0.0),
        last_at=max(arrivals, default=0.0),
        apis=dict(Counter(r.api for r in records)),
    )
