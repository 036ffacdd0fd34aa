"""The cache audit's counters as `kvmesh status` shows them: read from each decode worker's /metrics."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass

TIMEOUT_S = 1.0
_TOTAL = "kvmesh_cache_audit_total"
_MISMATCH = "kvmesh_cache_audit_mismatch_total"


@dataclass(slots=True)
class AuditCounts:
    audited: int = 0
    mismatches: int = 0
    workers_read: int = 0  # decode workers whose /metrics answered

    def as_dict(self) -> dict[str, int]:
        return {"audited": self.audited, "mismatches": self.mismatches, "workers_read": self.workers_read}


def parse_counts(metrics_text: str) -> tuple[int, int]:
    """(audited, mismatches) from a Prometheus text exposition."""
    values = {_TOTAL: 0.0, _MISMATCH: 0.0}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in values:
            values[name] = float(value)
    return int(values[_TOTAL]), int(values[_MISMATCH])


def read_audit_counts(endpoints: Iterable[tuple[str, str]]) -> AuditCounts:
    """Sum over (name, base url) of the decode workers (names `decode-*`); an unreachable one is skipped."""
    counts = AuditCounts()
    for name, url in endpoints:
        if not name.startswith("decode"):
            continue
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=TIMEOUT_S) as resp:
                audited, mismatches = parse_counts(resp.read().decode())
        except (urllib.error.URLError, OSError, ValueError):
            continue
        counts.audited += audited
        counts.mismatches += mismatches
        counts.workers_read += 1
    return counts
