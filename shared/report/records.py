"""Served-traffic records for the report: from the running stack's TRAFFIC stream or a recorded JSONL trace.

A recorded trace line (`kvmesh trace record`) is a `TrafficRecord` plus the
sim's `timestamp`; a line without the record's own fields (`at`, `tenant`,
`api`: a plain Mooncake trace) is refused rather than filled with guesses,
since the report prices what was served.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from kvmesh.protocol.traffic import TrafficRecord
from pydantic import ValidationError

SIM_ONLY_FIELDS = ("timestamp",)


class RecordsError(ValueError):
    """A trace file that does not hold served-traffic records."""


def parse_record_line(line: str, where: str = "line") -> TrafficRecord:
    """One recorded trace line as a `TrafficRecord` (the sim's `timestamp` dropped)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RecordsError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise RecordsError(f"{where}: not a JSON object")
    missing = [k for k in ("at", "tenant", "api") if k not in obj]
    if missing:
        raise RecordsError(f"{where}: not a served-traffic record (no {', '.join(missing)}); "
                           "record one with `kvmesh trace record`")
    fields = {k: v for k, v in obj.items() if k not in SIM_ONLY_FIELDS}
    try:
        return TrafficRecord.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise RecordsError(f"{where}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def load_records(path: Path) -> list[TrafficRecord]:
    """Every record of a recorded JSONL trace (blank lines skipped), in arrival order."""
    out = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                out.append(parse_record_line(line, f"{path.name}:{n}"))
    return sorted(out, key=lambda r: r.at)


def since(records: Iterable[TrafficRecord], start: float | None) -> list[TrafficRecord]:
    """The records that arrived at or after `start` (unix seconds; None: all), in arrival order."""
    return sorted((r for r in records if start is None or r.at >= start), key=lambda r: r.at)
