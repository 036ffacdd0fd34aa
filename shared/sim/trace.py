"""Hash-id request traces (Mooncake format) and their block keys.

One JSON object per line: ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, the chained ids of the request's
512-token input blocks (equal leading ids = shared prefix). Agent traces add
two optional fields: ``session_id`` (string) and ``tool_calls``, the tool
names this turn's answer called (``[]``: a plain answer). That is what the
server knows when a turn ends; a trace never carries the gap to the next one.
Recorded traffic (`kvmesh trace record`) adds ``block_tokens``, the tokens
per hash id of the fleet that served it (absent: 512, as in Mooncake's), and
fields the sim ignores (tenant, usage, timing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request of a trace: its arrival time (s) and its block chain as cache keys."""

    time_s: float
    input_length: int
    output_length: int
    blocks: tuple[bytes, ...]
    session_id: str | None = None
    tool_calls: tuple[str, ...] | None = None  # None: the trace does not say how the turn ended
    parent_session_id: str | None = None  # the session a sub-agent was forked from (with `session_id` only)
    block_size: int = TRACE_BLOCK_TOKENS  # tokens per hash id (the line's ``block_tokens``)

    def block_tokens(self, index: int) -> int:
        """Tokens in block ``index``: full blocks, except a partial last one."""
        if index < len(self.blocks) - 1:
            return self.block_size
        rest = self.input_length - self.block_size * (len(self.blocks) - 1)
        return rest if 0 < rest <= self.block_size else self.block_size


@dataclass(slots=True, frozen=True)
class Trace:
    name: str
    requests: tuple[TraceRequest, ...]

    @property
    def input_blocks(self) -> int:
        return sum(len(r.blocks) for r in self.requests)

    @property
    def unique_blocks(self) -> int:
        return len({b for r in self.requests for b in r.blocks})


def returning(trace: Trace) -> list[bool]:
    """Per request: a later turn of a session the trace named before (its prefix was computed then).
    A session's first turn is cold under every policy; a trace without session ids has no returning turns."""
    seen: set[str] = set()
    out = []
    for r in trace.requests:
        out.append(r.session_id is not None and r.session_id in seen)
        if r.session_id is not None:
            seen.add(r.session_id)
    return out


def block_key(hash_id: int) -> bytes:
    """A trace's integer hash id as the cache's bytes key (fixed width, deterministic)."""
    return hash_id.to_bytes(8, "big", signed=False)


def parse_line(line: str) -> TraceRequest:
    obj = json.loads(line)
    return TraceRequest(
        time_s=float(obj["timestamp"]) / 1000.0,
        input_length=int(obj["input_length"]),
        output_length=int(obj.get("output_length", 0)),
        blocks=tuple(block_key(int(h)) for h in obj["hash_ids"]),
        session_id=None if obj.get("session_id") is None else str(obj["session_id"]),
        tool_calls=None if obj.get("tool_calls") is None else tuple(str(t) for t in obj["tool_calls"]),
        parent_session_id=None if obj.get("parent_session_id") is None else str(obj["parent_session_id"]),
        block_size=int(obj.get("block_tokens") or TRACE_BLOCK_TOKENS),
    )


def load_trace(path: Path, limit: int | None = None) -> Trace:
    """Read a JSONL trace (blank lines skipped); ``limit`` keeps the first N requests."""
    requests: list[TraceRequest] = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(requests) >= limit:
                break
            if line.strip():
                requests.append(parse_line(line))
    return Trace(name=path.name, requests=tuple(requests))
