"""Hand-made served-traffic records for the report tests (the contract's fields, nothing invented), and a price
file whose numbers make the arithmetic easy to follow by hand."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from kvmesh.protocol.traffic import TrafficRecord

T0 = 1_790_000_000.0  # a fixed arrival origin (unix seconds)

PRICES = yaml.safe_load("""
as_of: "2026-01-01"
hosted:
  a: {model: a-1, input: 2.0, cached_input: 0.5, output: 10.0, cache_write: {300: 1.25, 3600: 2.0}}
  b: {model: b-1, input: 1.0, cached_input: 0.1, output: 4.0, cache_write: {}, storage_per_mtok_hour: 1.0}
self_built:
  gpu: test-gpu
  gpu_hour_usd: 3.6
  model: tiny
  params: 1000000000
  layers: 2
  q_heads: 4
  head_dim: 8
  peak_tflops: 1
  mfu: 0.5
  decode_tokens_per_s: 50
rules:
  volatile_peak_to_mean: 3
  hosted_ttft_ms: 2000
  small_volume_requests_per_day: 100000
  self_built_requests_per_day: 1000000
  session_turns: 5
  shared_instances: 2
  cross_instance_hit_share: 0.05
""")


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
