"""Hand-made served-traffic records for the report tests (the contract's fields, nothing invented)."""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.protocol.traffic import TrafficRecord

T0 = 1_790_000_000.0  # a fixed arrival origin (unix seconds)


def record(at: float, input_length: int, output_length: int = 10, *, cached: int = 0,
           writes: dict[str, int] | None = None, session: str | None = None, worker: str = "w0",
           tiers: dict[str, int] | None = None, hash_ids: list[int] | None = None,
           block_tokens: int = 100) -> TrafficRecord:
    return TrafficRecord(
        at=T0 + at, input_length=input_length, output_length=output_length,
        hash_ids=hash_ids if hash_ids is not None else list(range(input_length // block_tokens)),
        block_tokens=block_tokens, session_id=session, tool_calls=[], tenant="0123456789ab", api="openai.chat",
        worker=worker, cached_tokens=cached, tier_tokens=tiers or {}, cache_write_tokens=writes or {},
        ttft_ms=5.0,
    )


def write_jsonl(records: list[TrafficRecord], path: Path) -> Path:
    """The records as recorded trace lines (the shared/traffic writer: what `kvmesh trace record` writes)."""
    from kvmesh.traffic.trace_lines import write_trace

    write_trace(records, path)
    return path


def read_json(text: str) -> dict:
    return json.loads(text)
