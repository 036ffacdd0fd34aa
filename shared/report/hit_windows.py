"""Hit rate over time against Belady, the self-built baseline and an infinite cache, offline on the same records.

The records become the sim trace `kvmesh sim` would read (shared/traffic
trace lines through shared/sim/trace.parse_line), and the sim's own
`BeladyPolicy` runs over one L1 of the fleet's pooled capacity, request by
request, so each window gets its own Belady hits. `lru_l1` is the
self-built baseline at the same capacity (shared/report/l1_baseline.py):
one engine's LRU prefix cache. Blocks are the prompt's full blocks
(`hash_ids`), hits leading blocks only, as everywhere in kvmesh.

Two served figures per window: `served_device` (blocks hit in some worker's
device pool: own L1 or a peer's), the one Belady at the pooled L1 capacity
bounds, and `served` (any tier, L2/L3 included), which only `infinite` bounds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvmesh.cache_policy.policy_cache import BlockSpec
from kvmesh.protocol.traffic import TrafficRecord
from kvmesh.report.l1_baseline import L1Baseline, lru_l1
from kvmesh.report.measure import record_tiers
from kvmesh.report.served_trace import as_sim_trace
from kvmesh.sim.belady import BeladyPolicy
from kvmesh.sim.tiers import TieredCache


@dataclass(frozen=True, slots=True)
class Window:
    start_s: float  # seconds since the first request
    requests: int
    blocks: int
    served: float
    served_device: float
    belady: float
    lru_l1: float
    infinite: float


@dataclass(frozen=True, slots=True)
class HitCurve:
    capacity_blocks: int
    window_s: float
    windows: tuple[Window, ...]
    totals: Window

    def to_json(self) -> dict:
        return {"capacity_blocks": self.capacity_blocks, "window_s": self.window_s,
                "totals": asdict(self.totals), "windows": [asdict(w) for w in self.windows]}


def served_blocks(record: TrafficRecord) -> tuple[int, int]:
    """Whole prompt blocks the record hit: in any tier, and in some device pool (own L1 or a peer's)."""
    tiers = record_tiers(record)
    blocks = len(record.hash_ids)
    device = tiers.get("l1", 0) + tiers.get("peer", 0)
    return (min(blocks, record.cached_tokens // record.block_tokens), min(blocks, device // record.block_tokens))


def window_length(span_s: float, windows: int = 30) -> float:
    """About `windows` windows over the span, never shorter than a minute."""
    return max(60.0, span_s / windows)


def hit_curve(records: list[TrafficRecord], capacity_blocks: int, window_s: float | None = None,
              baseline: L1Baseline | None = None) -> HitCurve:
    """Per-window hit rates (blocks hit / prompt blocks) of the served records, Belady, the baseline's LRU L1
    and infinite; `baseline` (None: replayed here) must be `lru_l1` of the same records and capacity."""
    ordered = sorted(records, key=lambda r: r.at)  # the order trace_lines gives the sim
    trace = as_sim_trace(ordered)
    lru = baseline or lru_l1(ordered, max(1, capacity_blocks))  # also each request's infinite-cache hit
    oracle = BeladyPolicy(trace)
    cache = TieredCache(oracle, max(1, capacity_blocks))
    span = trace.requests[-1].time_s if trace.requests else 0.0
    width = window_s or window_length(span)
    sums: dict[int, list[int]] = {}
    for i, (record, request) in enumerate(zip(ordered, trace.requests, strict=True)):
        oracle.at_request(i)
        specs = [BlockSpec(block_hash=b, num_tokens=request.block_tokens(k)) for k, b in enumerate(request.blocks)]
        belady = cache.request(specs, request.time_s).l1
        row = sums.setdefault(int(request.time_s // width), [0] * 7)
        for k, n in enumerate((1, len(request.blocks), *served_blocks(record), belady, lru.hit_blocks[i],
                               lru.seen_blocks[i])):
            row[k] += n
    windows = tuple(_window(k * width, row) for k, row in sorted(sums.items()))
    total = [sum(row[k] for row in sums.values()) for k in range(7)]
    return HitCurve(capacity_blocks, width, windows, _window(0.0, total))


def _window(start: float, row: list[int]) -> Window:
    requests, blocks, served, device, belady, lru, infinite = row
    rate = (lambda n: n / blocks if blocks else 0.0)
    return Window(start, requests, blocks, rate(served), rate(device), rate(belady), rate(lru), rate(infinite))
