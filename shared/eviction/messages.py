"""What the eviction service says to workers and what it answers on `EVICTION_PIN`.

Commands travel on `subjects.commands(worker)` (stream COMMANDS, work queue)
as one `WorkerCommand` each; they are advice: a worker applies what still
holds (a block since taken by a request, or already gone, is skipped) and a
redelivered command changes nothing more (every action is idempotent).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from shared.kv_events.events import HexHash
from shared.protocol.base import Message
from shared.tiers.miss import Tier


class Demote(Message):
    """Move `hashes` (leaves first) from `src` to the next tier down: L1 -> L2, or L2 -> L3 (already in L3)."""

    kind: Literal["demote"] = "demote"
    hashes: list[HexHash] = Field(min_length=1)
    src: Tier


class Drop(Message):
    """Forget `hashes` in `tier` without keeping a copy below (what L3 or a peer holds stays)."""

    kind: Literal["drop"] = "drop"
    hashes: list[HexHash] = Field(min_length=1)
    tier: Tier


class Warm(Message):
    """Fetch these L3 chunk objects (keys, hottest first) into the worker's L2 before requests ask."""

    kind: Literal["warm"] = "warm"
    keys: list[str] = Field(min_length=1)


class Retain(Message):
    """Keep a session's chain (`hashes`, root first) in L1 until `until` (unix seconds): it is expected back.

    With `fetch` (a prefetch) the part of the chain not in L1 is first brought back from L2 or L3
    under the tenant's hash keys (`tenant_salt`, hex). Pins stay within the worker's pin budget.
    """

    kind: Literal["retain"] = "retain"
    hashes: list[HexHash] = Field(min_length=1)
    until: float
    fetch: bool = False
    tenant_salt: str = ""
    session_id: str = ""  # for logs


Command = Annotated[Demote | Drop | Warm | Retain, Field(discriminator="kind")]


class WorkerCommand(Message):
    """One command for `worker`; `command_id` is its Nats-Msg-Id (a republish is dropped)."""

    worker: str = Field(min_length=1)
    command_id: str = Field(min_length=1)
    command: Command


class PinRequest(Message):
    """Keep `hashes` (a prompt prefix) for `ttl_s`: never demoted out of L1/L2 by advice, never deleted from L3."""

    hashes: list[HexHash] = Field(min_length=1)
    ttl_s: float = Field(gt=0)


class PinReply(Message):
    pinned: int = Field(ge=0)
    until: float  # unix seconds; a later pin of the same hash only extends it
