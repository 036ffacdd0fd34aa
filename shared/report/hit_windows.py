"""Hit rate over time against Belady and an infinite cache, computed offline on the same records.

The records become the sim trace `kvmesh sim` would read (shared/traffic
trace lines through shared/sim/trace.parse_line), and the sim's own
`BeladyPolicy` runs over one L1 of the fleet's pooled capacity, request by
request, so each window gets its own Belady hits. Blocks are the prompt's
full blocks (`hash_ids`), hits leading blocks only, as everywhere in kvmesh.

Two served figures per window: `served_device` (blocks hit in some worker's
device pool: own L1 or a peer's), the one Belady at the pooled L1 capacity
bounds, and `served` (any tier, L2/L3 included), which only `infinite` bounds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from kvmesh.cache_policy.policy_cache import BlockSpec
from kvmesh.protocol.traffic import TrafficRecord
from kvmesh.report.measure import record_tiers
from kvmesh.sim.belady import BeladyPolicy
from kvmesh.sim.tiers import TieredCache
from kvmesh.sim.trace import Trace, parse_line
from kvmesh.traffic.trace_lines import trace_lines


@dataclass(frozen=True, slots=True)
class Window:
    start_s: float  # seconds since the first request
    requests: int
    blocks: int
    served: float
    served_device: float
    belady: float
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


def as_trace(records: list[TrafficRecord]) -> Trace:
    """The records as the sim reads them (the same lines `kvmesh trace record` writes)."""
    return Trace("served", tuple(parse_line(json.dumps(line)) for line in trace_lines(records)))


def served_blocks(record: TrafficRecord) -> tuple[int, int]:
    """Whole prompt blocks the record hit: in any tier, and in some device pool (own L1 or a peer's)."""
    tiers = record_tiers(record)
    blocks = len(record.hash_ids)
    device = tiers.get("l1", 0) + tiers.get("peer", 0)
    return (min(blocks, record.cached_tokens // record.block_tokens), min(blocks, device // record.block_tokens))


def window_length(span_s: float, windows: int = 30) -> float:
    """About `windows` windows over the span, never shorter than a minute."""
    return max(60.0, span_s / windows)


def hit_curve(records: list[TrafficRecord], capacity_blocks: int, window_s: float | None = None) -> HitCurve:
    """Per-window hit rates (blocks hit / prompt blocks) of the served records, Belady and infinite."""
    ordered = sorted(records, key=lambda r: r.at)  # the order trace_lines gives the sim
    trace = as_trace(ordered)
    oracle = BeladyPolicy(trace)
    cache = TieredCache(oracle, max(1, capacity_blocks))
    seen: set[bytes] = set()
    span = trace.requests[-1].time_s if trace.requests else 0.0
    width = window_s or window_length(span)
    sums: dict[int, list[int]] = {}
    for i, (record, request) in enumerate(zip(ordered, trace.requests, strict=True)):
        oracle.at_request(i)
        specs = [BlockSpec(block_hash=b, num_tokens=request.block_tokens(k)) for k, b in enumerate(request.blocks)]
        belady = cache.request(specs, request.time_s).l1
        infinite = 0
        for b in request.blocks:
            if b not in seen:
                break
            infinite += 1
        seen.update(request.blocks)
        row = sums.setdefault(int(request.time_s // width), [0] * 6)
        for k, n in enumerate((1, len(request.blocks), *served_blocks(record), belady, infinite)):
            row[k] += n
    windows = tuple(_window(k * width, row) for k, row in sorted(sums.items()))
    total = [sum(row[k] for row in sums.values()) for k in range(6)]
    return HitCurve(capacity_blocks, width, windows, _window(0.0, total))


def _window(start: float, row: list[int]) -> Window:
    requests, blocks, served, device, belady, infinite = row
    rate = (lambda n: n / blocks if blocks else 0.0)
    return Window(start, requests, blocks, rate(served), rate(device), rate(belady), rate(infinite))
