"""The served-traffic record: one `TrafficRecord` per finished request, on stream TRAFFIC.

The ingress publishes it on `subjects.traffic(<ingress id>)` when a request's
last token was delivered (shared/ingress/sessions/traffic.py); `kvmesh trace
record`, live Belady (shared/eviction/live_belady.py) and the cost report
read it back (shared/traffic/reader.py). Its fields are a superset of a sim
trace line (shared/sim/trace.py), so a recording replays through `kvmesh
sim` unchanged (`shared/traffic/trace_lines.py` writes the lines).

Privacy: no prompt or output text. Block ids are the served chain hashes
(already salted per tenant) cut to 63 bits (`hash_id`); the tenant and the session are
hashed (`tenant_tag`, `session_tag`), so nothing links two tenants.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from kvmesh.protocol.base import Message
from pydantic import Field, field_validator

Api = Literal["openai.chat", "openai.completions", "openai.responses", "anthropic.messages"]
TIERS = ("l1", "l2", "peer", "l3")
_ID_MASK = (1 << 63) - 1
DEFAULT_BLOCK_TOKENS = 512  # a line without `block_tokens` is a Mooncake trace line


def hash_id(block_hash: bytes) -> int:
    """A served block hash as a trace's integer id: its first 8 bytes, big-endian, top bit cleared. 63 bits
    fit a signed 64-bit integer, which every JSON reader parses natively (a wider one is a big integer: a
    third slower to parse in the live Belady upkeep), as the trajectory traces' ids do (ID_MASK)."""
    return int.from_bytes(block_hash[:8], "big") & _ID_MASK


def tenant_tag(tenant: str) -> str:
    """The tenant as a record names it: never the raw name."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:12]


def session_tag(tenant: str, client_session_id: str) -> str:
    """The session as a record names it, scoped to its tenant (two tenants' "chat-1" differ)."""
    return hashlib.sha256(f"{tenant}:{client_session_id}".encode()).hexdigest()[:16]


class TrafficRecord(Message):
    """One finished request, as served. Token counts are the prompt's and the output's; `tier_tokens` says
    where the `cached_tokens` came from and sums to it; `cache_write_tokens` maps a TTL in seconds (as a
    string) to the prompt tokens written under it (cache_control breakpoints, named caches)."""

    at: float  # unix seconds the request arrived at the ingress
    input_length: int = Field(ge=0)
    output_length: int = Field(ge=0)
    hash_ids: list[int] = Field(default_factory=list)  # the prompt's full blocks, chain order; 63 bits each
    block_tokens: int = Field(default=DEFAULT_BLOCK_TOKENS, ge=1)
    session_id: str | None = None  # session_tag(...)
    tool_calls: list[str] | None = None  # [] a plain answer; None unknown
    tenant: str  # tenant_tag(...)
    api: Api
    worker: str = ""  # the prefill worker that served it
    cached_tokens: int = Field(default=0, ge=0)
    tier_tokens: dict[str, int] = Field(default_factory=dict)  # keys in TIERS
    cache_write_tokens: dict[str, int] = Field(default_factory=dict)
    ttft_ms: float | None = None
    finish_reason: str = "stop"

    @field_validator("hash_ids")
    @classmethod
    def _eight_bytes(cls, ids: list[int]) -> list[int]:
        # one check over the list: a per-item constraint costs the live Belady upkeep twice the parse time
        if ids and not (0 <= min(ids) and max(ids) <= _ID_MASK):
            raise ValueError("a hash id is a 63-bit unsigned integer")
        return ids

    def hit_blocks(self) -> int:
        """Prompt blocks served from cache (any tier): whole blocks only, as the engine reuses them."""
        return min(len(self.hash_ids), self.cached_tokens // self.block_tokens)

    def l1_hit_blocks(self) -> int:
        """Prompt blocks the serving worker found in its own device pool (all cached ones if it did not say)."""
        tiers = self.tier_tokens or {"l1": self.cached_tokens}
        return min(len(self.hash_ids), tiers.get("l1", 0) // self.block_tokens)
