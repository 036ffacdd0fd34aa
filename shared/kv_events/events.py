"""KV events: what a worker tells the cache index about the blocks it holds.

A worker numbers its events 1, 2, 3 ... within an epoch (one process
lifetime; the epoch id is the start time in ns, so a newer incarnation has a
larger id). The first event of every epoch is `WorkerCleared`: whatever the
index held for an older epoch of that worker is gone. Events travel in
`KVEventBatch`es of consecutive sequence numbers on `subjects.kv_events(worker)`
(stream KV_EVENTS); the index detects a missing number and asks the worker for
a state dump. Hashes are hex strings of the engine's `BlockHash` bytes.
Every event is idempotent (set or clear a tier of a block), so a duplicate
or a replay after a dump changes nothing.
"""

from __future__ import annotations

from typing import Annotated, Literal

from kvmesh.protocol.base import Message
from kvmesh.protocol.blocks import Tier
from pydantic import Field, StringConstraints, model_validator

# A block hash (SHA-256, shared/protocol/block_hash.py) in lowercase hex.
HexHash = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]

# Tiers an index entry can name. PEER is a way of reaching another worker's L2, not a place.
INDEXED_TIERS = (Tier.L1, Tier.L2, Tier.L3)


class BlockStored(Message):
    """`hashes` (a chain run, in order; `parent` precedes the first) now held in `tier`.

    `session_id` is the tenant-scoped session (shared/sessions/identity.py) whose request stored the run,
    when the worker knew it: set on the runs a worker registers for a job (L2); None for the engine's own
    L1 stores, which it makes without a request's context, and for L3 uploads."""

    # 2: `session_id` (a new field is a new wire format: strict parsing rejects fields it does not know)
    SCHEMA_VERSION = 2

    kind: Literal["stored"] = "stored"
    seq: int = Field(ge=1)
    hashes: list[HexHash] = Field(min_length=1)
    parent: HexHash | None = None
    tokens_per_block: int = Field(ge=1)
    tier: Tier
    session_id: str | None = None


class BlockRemoved(Message):
    """`hashes` are no longer held in `tier` (evicted or deleted)."""

    kind: Literal["removed"] = "removed"
    seq: int = Field(ge=1)
    hashes: list[HexHash] = Field(min_length=1)
    tier: Tier


class BlockMoved(Message):
    """`hashes` left `src` and are now in `dst` (demotion L1 -> L2 -> L3, or a promotion)."""

    kind: Literal["moved"] = "moved"
    seq: int = Field(ge=1)
    hashes: list[HexHash] = Field(min_length=1)
    src: Tier
    dst: Tier


class WorkerCleared(Message):
    """The worker holds nothing in L1/L2: the start of epoch `epoch` (a restart), or an explicit clear."""

    kind: Literal["cleared"] = "cleared"
    seq: int = Field(ge=1)
    epoch: int = Field(ge=0)  # the same as its batch's; here too so the event reads on its own


KVEvent = Annotated[BlockStored | BlockRemoved | BlockMoved | WorkerCleared, Field(discriminator="kind")]


class KVEventBatch(Message):
    """Consecutive events of one worker epoch: `events[i].seq == events[0].seq + i`."""

    worker: str = Field(min_length=1)
    epoch: int = Field(ge=0)
    events: list[KVEvent] = Field(min_length=1)

    @model_validator(mode="after")
    def _consecutive(self) -> KVEventBatch:
        first = self.events[0].seq
        if any(e.seq != first + i for i, e in enumerate(self.events)):
            raise ValueError("events must carry consecutive sequence numbers")
        if any(isinstance(e, WorkerCleared) and e.epoch != self.epoch for e in self.events):
            raise ValueError("a WorkerCleared names another epoch than its batch")
        return self

    @property
    def first_seq(self) -> int:
        return self.events[0].seq

    @property
    def last_seq(self) -> int:
        return self.events[-1].seq

    def msg_id(self) -> str:
        """The Nats-Msg-Id: a republish of the same batch is dropped by the stream's duplicate window."""
        return f"kvev-{self.worker}-{self.epoch}-{self.first_seq}-{self.last_seq}"


class StateDumpRequest(Message):
    """Asks a worker for its whole L1/L2 state (sent when the index saw a sequence gap)."""

    max_hashes_per_chunk: int = Field(ge=1)


class StateDumpChunk(Message):
    """One part of a worker's state as of event `seq` of `epoch`; the reply is `chunks` of these."""

    worker: str
    epoch: int
    seq: int = Field(ge=0)  # every event <= seq is reflected in the state; later ones may be too
    chunk: int = Field(ge=0)
    chunks: int = Field(ge=1)
    l1: list[HexHash]
    l2: list[HexHash]
