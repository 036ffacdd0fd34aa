"""What the eviction service says to workers and what it answers on `EVICTION_PIN`.

Commands travel on `subjects.commands(worker)` (stream COMMANDS, work queue)
as one `WorkerCommand` each; they are advice: a worker applies what still
holds (a block since taken by a request, or already gone, is skipped) and a
redelivered command changes nothing more (every action is idempotent).
"""

from __future__ import annotations

from typing import Annotated, Literal

from kvmesh.kv_events.events import HexHash
from kvmesh.protocol.base import Message
from kvmesh.protocol.blocks import Tier
from pydantic import Field


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
    under the tenant's hash keys (`tenant_salt`, hex), and with `owner` first from that worker
    (a prefill worker streaming a prompt it hands off here: shared/serving/prefill_stream.py).
    Pins stay within the worker's pin budget.
    """

    kind: Literal["retain"] = "retain"
    hashes: list[HexHash] = Field(min_length=1)
    until: float
    fetch: bool = False
    tenant_salt: str = ""
    session_id: str = ""  # for logs
    owner: str = ""  # with fetch: the worker whose L2 holds the chain


Command = Annotated[Demote | Drop | Warm | Retain, Field(discriminator="kind")]


class WorkerCommand(Message):
    """One command for `worker`; `command_id` is its Nats-Msg-Id (a republish is dropped)."""

    worker: str = Field(min_length=1)
    command_id: str = Field(min_length=1)
    command: Command


class PinRequest(Message):
    """Keep `hashes` (a prompt prefix) for `ttl_s`: never demoted out of L1/L2 by advice, never deleted from L3.

    The pin counts `block_bytes` per block not yet pinned (0: the service's own figure) against `tenant`'s
    cap and the deployment's (shared/eviction/pins.py). `whole`: all or nothing (a named cache); else a
    pool full for everyone pins the leading run that fits. `release`: unpin `hashes` instead (a deleted
    named cache frees its budget).
    """

    SCHEMA_VERSION = 2  # 2: tenant, block_bytes, whole, release

    hashes: list[HexHash] = Field(min_length=1)
    ttl_s: float = Field(gt=0)
    tenant: str = ""  # the L3 namespace (from the tenant's salt, shared/serving/worker_tiers.py namespace_for)
    block_bytes: int = Field(default=0, ge=0)
    whole: bool = False
    release: bool = False


class PinReply(Message):
    """`pinned` leading blocks are pinned until `until`; `refused` names the cap that stopped the rest."""

    SCHEMA_VERSION = 2  # 2: refused, cap_bytes, used_bytes, wanted_bytes

    pinned: int = Field(ge=0)
    until: float  # unix seconds; a later pin of the same hash only extends it
    refused: Literal["tenant", "pool"] | None = None
    cap_bytes: int | None = None  # the cap that refused (None: unbounded or nothing refused)
    used_bytes: int = 0  # what the tenant (refused: tenant) or the pool (otherwise) holds pinned now
    wanted_bytes: int = 0  # new pinned bytes the request asked for
