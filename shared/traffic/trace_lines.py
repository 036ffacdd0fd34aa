"""Traffic records as sim trace lines (shared/sim/trace.py reads them; `kvmesh sim` replays them).

A line is the record's fields plus `timestamp`, milliseconds since the
recording's first request (`origin`), which is what the sim orders by.
Everything else passes through: `hash_ids`, `block_tokens`, the hashed
`session_id` and `tenant`, `tool_calls`, the usage and timing fields.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvmesh.protocol.traffic import TrafficRecord


def to_trace_line(record: TrafficRecord, origin: float | None = None) -> dict:
    """One JSON-ready trace line; `origin` (unix seconds, default: this record's own arrival) is time 0."""
    line = record.model_dump(exclude={"schema_version"})
    line["timestamp"] = round(1000 * (record.at - (record.at if origin is None else origin)))
    return {"timestamp": line.pop("timestamp"), **line}


def trace_lines(records: Sequence[TrafficRecord]) -> list[dict]:
    """The records in arrival order, timed from the first one."""
    ordered = sorted(records, key=lambda r: r.at)
    origin = ordered[0].at if ordered else 0.0
    return [to_trace_line(r, origin) for r in ordered]


def write_trace(records: Iterable[TrafficRecord], path: Path) -> int:
    """Write the records as a JSONL trace at `path`; returns the lines written."""
    lines = trace_lines(list(records))
    with path.open("w") as f:
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    return len(lines)
