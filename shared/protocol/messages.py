"""Message models shared by every service (service-specific ones live beside their service's logic).

All are `Message`s: versioned, strict, `to_bytes()` / `from_bytes()`.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from kvmesh.protocol.base import Message
from pydantic import Field


class Role(StrEnum):
    INGRESS = "ingress"
    PREFILL = "prefill"
    DECODE = "decode"
    CACHE_INDEX = "cache-index"
    EVICTION = "eviction"
    VLLM = "vllm"  # a vLLM engine with kvmesh's connector: holds KV, takes no kvmesh jobs
    TEST = "test"


class Heartbeat(Message):
    """A worker's liveness record, the value under its id in the `workers` KV bucket.

    Written every heartbeat interval with a per-message TTL; when writes stop the
    key expires and watchers see the worker go away. `seq` increases by one per
    write of this process, so a restarted worker is recognisable by a new
    `started_at` and a reset `seq`. A worker that publishes KV events also
    says how far its event log is in the stream (`kv_epoch`, `kv_seq`), so
    the cache index notices a lost event even when no later one follows.
    A worker with KV tiers states their sizes in blocks (`l1_capacity_blocks`:
    its engine's device pool; `l2_capacity_blocks`: its host tier), so the
    eviction service advises each worker at its own capacity; None: not said
    (the service falls back to its settings).
    """

    worker_id: str = Field(min_length=1)
    role: Role
    load: float = Field(ge=0.0)  # 0..capacity: what the worker is doing now (running sequences)
    capacity: float = Field(ge=0.0)
    started_at: datetime
    http_endpoint: str  # "http://host:port" of its side server: /healthz /readyz /metrics
    seq: int = Field(ge=0)
    ttl_s: float = Field(gt=0)  # the entry's TTL: without a newer heartbeat by then, the worker is gone
    kv_epoch: int | None = Field(default=None, ge=0)
    kv_seq: int | None = Field(default=None, ge=0)  # events of kv_epoch up to this one are in KV_EVENTS
    l1_capacity_blocks: int | None = Field(default=None, ge=0)
    l2_capacity_blocks: int | None = Field(default=None, ge=0)


class ErrorReply(Message):
    """The body a request/reply endpoint answers with when its handler failed."""

    error: str
    retriable: bool = True
