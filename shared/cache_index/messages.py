"""The cache index's request/reply messages (`subjects.INDEX_LOOKUP`, `subjects.INDEX_SNAPSHOT`)."""

from __future__ import annotations

from kvmesh.cache_index.index import LookupResult
from kvmesh.kv_events.events import HexHash
from kvmesh.protocol.base import Message
from kvmesh.protocol.blocks import Tier
from pydantic import Field


class LookupRequest(Message):
    """A request's block hashes (hex), in chain order."""

    hashes: list[HexHash] = Field(max_length=1_000_000)


class TierRun(Message):
    tier: Tier
    blocks: int = Field(ge=1)


class WorkerMatch(Message):
    """`blocks` leading blocks of the request are on `worker`, in `runs` (tiers in chain order)."""

    worker: str
    blocks: int = Field(ge=1)
    runs: list[TierRun]


class LookupReply(Message):
    """Workers holding a leading run (longest first), the leading run in L3, and the index's readiness."""

    workers: list[WorkerMatch]
    l3_blocks: int = Field(ge=0)
    indexed_blocks: int = Field(ge=0)
    ready: bool  # False while catching up after a start: treat the answer as a hint ("degrade, don't fail")

    @classmethod
    def of(cls, result: LookupResult, indexed_blocks: int, ready: bool) -> LookupReply:
        workers = [
            WorkerMatch(worker=w, blocks=m.blocks, runs=[TierRun(tier=r.tier, blocks=r.blocks) for r in m.runs])
            for w, m in sorted(result.workers.items(), key=lambda kv: (-kv[1].blocks, kv[0]))
        ]
        return cls(workers=workers, l3_blocks=result.l3_blocks, indexed_blocks=indexed_blocks, ready=ready)


class SnapshotRequest(Message):
    """Ask the index to write a snapshot now."""


class SnapshotReply(Message):
    stream_seq: int = Field(ge=0)
    blocks: int = Field(ge=0)
    bytes: int = Field(ge=0)
    seconds: float = Field(ge=0)
