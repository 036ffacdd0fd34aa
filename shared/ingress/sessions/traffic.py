"""The ingress's one traffic hook: a `TrafficRecord` per finished request, published in the background.

`SessionTracker.finish` (every dialect calls it once, when a request's last
token was delivered) hands the turn and its `Usage` to `TrafficRecorder.
record`, which builds the record (shared/protocol/traffic.py: hashed tenant
and session, hash ids, usage per tier, writes by TTL, TTFT) and publishes it
on `subjects.traffic(<ingress id>)` with msg id `<request_id>:traffic`.
Serving never waits on it: the publish is a background task, at most
`MAX_PENDING` wait at once, and a record that is dropped or not taken by the
bus is counted in `kvmesh_traffic_records_lost_total` (and logged), never an
error to the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import get_args

from kvmesh.bus.publish import Publisher
from kvmesh.ingress.core.types import Usage
from kvmesh.ingress.sessions.turn import Turn
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.protocol.serving import CachePin
from kvmesh.protocol.traffic import Api, TrafficRecord, hash_id, session_tag, tenant_tag
from prometheus_client import CollectorRegistry, Counter

log = get_logger(__name__)

MAX_PENDING = 1024
APIS: dict[str, Api] = {"/v1/chat/completions": "openai.chat", "/v1/completions": "openai.completions",
                        "/v1/responses": "openai.responses", "/v1/messages": "anthropic.messages"}
assert set(APIS.values()) == set(get_args(Api))


def cache_writes(pins: Sequence[CachePin], cached_tokens: int, created_tokens: int) -> dict[str, int]:
    """Prompt tokens written under each pin's TTL (seconds, as a string): each pin covers the tokens past the
    cached prefix and past the shorter pins, capped in total by what the worker reported it wrote."""
    out: dict[str, int] = {}
    covered, left = cached_tokens, created_tokens
    for pin in sorted(pins, key=lambda p: p.num_tokens):
        key = str(round(pin.ttl_s))
        take = min(left, max(0, pin.num_tokens - covered))
        out[key] = out.get(key, 0) + take
        covered, left = max(covered, pin.num_tokens), left - take
    return out


def build_record(turn: Turn, usage: Usage, output_tokens: int, finish_reason: str | None,
                 tools: Sequence[str] | None, block_tokens: int) -> TrafficRecord:
    """The record of one finished turn (pure: no bus, no clock)."""
    ttft = None if not usage.first_token_at else round(1000 * (usage.first_token_at - turn.started_mono), 3)
    tier_tokens = usage.tier_tokens or {"l1": usage.cached_tokens, "l2": 0, "peer": 0, "l3": 0}
    return TrafficRecord(
        at=turn.started_at, input_length=usage.prompt_tokens or len(turn.prompt_ids), output_length=output_tokens,
        hash_ids=[hash_id(h) for h in turn.prompt_hashes], block_tokens=block_tokens,
        session_id=session_tag(turn.ref.tenant, turn.ref.client_id),
        tool_calls=None if tools is None else list(dict.fromkeys(tools)),
        tenant=tenant_tag(turn.ref.tenant), api=APIS.get(turn.path, "openai.chat"),
        worker=usage.prefill_worker, cached_tokens=usage.cached_tokens, tier_tokens=dict(tier_tokens),
        cache_write_tokens=cache_writes(usage.pins, usage.cached_tokens, usage.cache_created_tokens),
        ttft_ms=ttft, finish_reason=finish_reason or "stop",
    )


class TrafficRecorder:
    """One per ingress process; `record` never raises and never blocks."""

    def __init__(self, publisher: Publisher, ingress_id: str, registry: CollectorRegistry | None = None) -> None:
        self.publisher, self.subject = publisher, subjects.traffic(ingress_id)
        self.published = Counter("kvmesh_traffic_records", "Traffic records the bus took.", registry=registry)
        self.lost = Counter("kvmesh_traffic_records_lost", "Traffic records dropped or refused by the bus.",
                            registry=registry)
        self._pending: set[asyncio.Task[None]] = set()

    def record(self, request_id: str, build: TrafficRecord | None) -> None:
        """Publish `build` (None: it could not be built, counted as lost) in the background."""
        if build is None or len(self._pending) >= MAX_PENDING:
            self.lost.inc()
            return
        task = asyncio.create_task(self._publish(request_id, build))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish(self, request_id: str, record: TrafficRecord) -> None:
        try:
            await self.publisher.publish(self.subject, record, msg_id=f"{request_id}:traffic")
            self.published.inc()
        except Exception as exc:  # noqa: BLE001 - a lost record is counted, never the client's problem
            self.lost.inc()
            log.warning("traffic record not published", error=repr(exc))

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) for the records still being published (shutdown)."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)
