"""Live Belady as `kvmesh status` shows it: the eviction service's gauges, read from its /metrics."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterable

TIMEOUT_S = 1.0
# gauge name -> the key `kvmesh status --json` reports it under (`cache_belady`)
GAUGES = {
    "kvmesh_cache_hit_rate_actual": "actual",
    "kvmesh_cache_hit_rate_actual_any": "actual_any",
    "kvmesh_cache_hit_rate_belady": "belady",
    "kvmesh_cache_hit_rate_infinite": "infinite",
    "kvmesh_cache_belady_ratio": "belady_ratio",
    "kvmesh_cache_infinite_ratio": "infinite_ratio",
    "kvmesh_cache_belady_window_accesses": "window_accesses",
    "kvmesh_cache_belady_capacity_blocks": "capacity_blocks",
}


def parse_gauges(metrics_text: str) -> dict[str, float]:
    """The live Belady gauges present in a Prometheus text exposition."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in GAUGES:
            out[GAUGES[name]] = float(value)
    return out


def read_live_belady(endpoints: Iterable[tuple[str, str]]) -> dict[str, float]:
    """The gauges of the first eviction endpoint (name `eviction*`) that answers; {} if none does."""
    for name, url in endpoints:
        if not name.startswith("eviction"):
            continue
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=TIMEOUT_S) as resp:
                found = parse_gauges(resp.read().decode())
        except (urllib.error.URLError, OSError, ValueError):
            continue
        if found:
            return found
    return {}
