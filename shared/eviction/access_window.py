"""A bounded window of the fleet's served block accesses, from traffic records (live Belady's input).

Each finished request adds one entry: when it arrived, its prompt's block
ids (packed 8 bytes each into one `bytes`, the trace's key width), block
size, worker, session, and how many of its blocks the fleet actually served
from cache (own L1; any tier). The window keeps the newest entries whose
blocks sum to at most `max_accesses` and which arrived within `max_age_s`
of the newest; older ones leave first. A request with more blocks than the
whole window keeps its leading `max_accesses` (a prefix is still a chain).

Memory bound: 8 bytes per kept access plus about 140 bytes per entry (the
entry object and its packed bytes' header; session and worker strings are
shared), so at most `max_accesses * (8 + 140)` bytes (one block per request,
the worst case) and 12.5 bytes per access on Mooncake-shaped traffic (31
blocks a request: 3.3 MB for the default 262,144), measured by
bench/live_belady.py (`kvmesh bench live-belady`).
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from kvmesh.protocol.traffic import TrafficRecord
from kvmesh.sim.trace import Trace, TraceRequest

KEY_BYTES = 8


@dataclass(slots=True, frozen=True)
class Access:
    """One request's accesses, as the window keeps them."""

    at: float
    blocks: bytes  # KEY_BYTES per block, chain order
    block_size: int
    input_length: int
    worker: str
    session: str | None
    l1_hits: int  # blocks the serving worker found in its own L1
    hits: int  # blocks served from cache in any tier

    @property
    def count(self) -> int:
        return len(self.blocks) // KEY_BYTES

    def keys(self) -> tuple[bytes, ...]:
        return tuple(self.blocks[i:i + KEY_BYTES] for i in range(0, len(self.blocks), KEY_BYTES))

    @classmethod
    def of(cls, record: TrafficRecord, max_blocks: int) -> Access:
        ids = record.hash_ids[:max_blocks]
        return cls(record.at, struct.pack(f">{len(ids)}Q", *ids), record.block_tokens,
                   record.input_length, record.worker, record.session_id,
                   min(len(ids), record.l1_hit_blocks()), min(len(ids), record.hit_blocks()))


class AccessWindow:
    """Entries in arrival order, bounded by accesses and age (see the module docstring). Not thread-safe:
    one event loop adds; `snapshot()` hands a copy to a computation elsewhere."""

    def __init__(self, max_accesses: int, max_age_s: float) -> None:
        if max_accesses < 1 or max_age_s <= 0:
            raise ValueError("the window needs max_accesses >= 1 and max_age_s > 0")
        self.max_accesses, self.max_age_s = max_accesses, max_age_s
        self._entries: deque[Access] = deque()
        self._newest = float("-inf")
        self.accesses = 0  # blocks in the window
        self.dropped = 0  # entries that left it

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Access]:
        return iter(self._entries)

    def add(self, record: TrafficRecord) -> None:
        entry = Access.of(record, self.max_accesses)
        self._entries.append(entry)
        self.accesses += entry.count
        self._newest = max(self._newest, entry.at)
        self._trim()

    def _trim(self) -> None:
        horizon = self._newest - self.max_age_s
        while self._entries and (self.accesses > self.max_accesses or self._entries[0].at < horizon):
            self.accesses -= self._entries.popleft().count
            self.dropped += 1

    def snapshot(self) -> list[Access]:
        return list(self._entries)

    def workers(self) -> set[str]:
        return {e.worker for e in self._entries if e.worker}


def as_trace(entries: list[Access], name: str = "live") -> Trace:
    """The entries as a sim trace, in arrival order (stable: equal times keep the stream's order), exactly as
    `kvmesh trace record` writes the same records, so `kvmesh sim` replays the same requests."""
    ordered = sorted(entries, key=lambda e: e.at)
    origin = ordered[0].at if ordered else 0.0
    return Trace(name, tuple(
        TraceRequest(time_s=round(1000 * (e.at - origin)) / 1000.0, input_length=e.input_length, output_length=0,
                     blocks=e.keys(), session_id=e.session, block_size=e.block_size)
        for e in ordered))
