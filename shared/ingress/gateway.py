"""The dialect-independent core of the ingress: a validated request in, an ordered token stream out.

A dialect module (OpenAI, Anthropic) authenticates, validates and builds a
`GenerationRequest` (prompt ids, sampling, pins), then either iterates
`Gateway.stream(req)` (SSE) or awaits `Gateway.complete(req)`. The stream
yields `TokenEvent`s in seq order without duplicates, each holding only
tokens the caller has not seen; the last has `finished=True`. Failures that
supervision cannot repair raise `GatewayError` (never a silent short stream).
Leaving the iteration early (client gone) aborts the request on its worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.bus.publish import Publisher
from kvmesh.config import IngressSettings
from kvmesh.ingress.errors import ErrorKind
from kvmesh.ingress.prefix_locator import PrefixLocator
from kvmesh.ingress.router import Router, WorkerTable
from kvmesh.protocol.messages import Role
from kvmesh.protocol.serving import CachePin, SamplingSpec, TokenEvent
from nats.aio.client import Client as NATS


@dataclass(slots=True)
class GenerationRequest:
    """What a dialect hands the gateway after auth and validation; nothing here comes unchecked from a client."""

    request_id: str  # a subject token: letters, digits, '-', '_'
    tenant: str
    tenant_salt: str  # hex, from auth.KeyRing
    prompt_ids: list[int]
    sampling: SamplingSpec
    session_id: str | None = None
    affinity_key: str | None = None  # prompt_cache_key, else session id: routes to the same workers
    pins: list[CachePin] = field(default_factory=list)
    prefill_only: bool = False  # named-cache creation: store the prompt's blocks, generate nothing
    block_hashes: list[bytes] | None = None  # the prompt's full blocks as the workers hash them, if known


@dataclass(slots=True)
class Usage:
    """Usage as the first event of a request reports it (prefill knows the prompt and its cache hit),
    and where the request ran (filled by the supervisor: the last workers and the attempts it took)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_created_tokens: int = 0
    prefill_worker: str = ""
    decode_worker: str = ""
    attempts: int = 1
    first_token_at: float = 0.0  # time.monotonic() when the first token arrived
    finished_by: str = ""  # the worker that sent the final event: its L1 holds the turn's chain
    tier_tokens: dict[str, int] | None = None  # where cached_tokens came from, if the prefill worker said
    pins: list[CachePin] = field(default_factory=list)  # what the request asked to keep (writes by TTL)

    def take(self, event: TokenEvent) -> None:
        if not self.first_token_at:
            self.first_token_at = time.monotonic()
        if event.finished:
            self.finished_by = event.worker_id
        if event.prompt_tokens and not self.prompt_tokens:
            self.prompt_tokens = event.prompt_tokens
            self.cached_tokens = event.cached_tokens
            self.tier_tokens = event.tier_tokens
        self.cache_created_tokens = max(self.cache_created_tokens, event.cache_created_tokens)


def route_header(usage: Usage) -> dict[str, str]:
    """`kvmesh-route: prefill=<id>;decode=<id>;attempts=<n>`: where a request ran, for operators and tests."""
    return {"kvmesh-route": f"prefill={usage.prefill_worker};decode={usage.decode_worker};attempts={usage.attempts}"}


@dataclass(slots=True)
class Completion:
    """A whole response (non-streaming): the concatenated stream and its usage."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    cache_created_tokens: int
    usage: Usage


class GatewayError(Exception):
    """The request cannot finish; `kind` picks the dialect's status, `retriable` tells the client to retry."""

    def __init__(self, kind: ErrorKind, message: str, retriable: bool = True) -> None:
        super().__init__(message)
        self.kind, self.message, self.retriable = kind, message, retriable


class Gateway:
    """Runs requests over the bus; one per ingress process."""

    def __init__(self, nc: NATS, publisher: Publisher, table: WorkerTable, settings: IngressSettings,
                 detokenize: Callable[[Sequence[int]], str], on_retry: Callable[[], None] = lambda: None,
                 locator: PrefixLocator | None = None, on_stale_event: Callable[[], None] = lambda: None) -> None:
        self.nc, self.publisher, self.table, self.settings = nc, publisher, table, settings
        self.on_retry = on_retry  # counts prefill retries and decode migrations
        self.on_stale_event = on_stale_event  # counts token events of replaced attempts, dropped unseen
        self.router = Router.of(table, settings)
        self.locator = locator  # None: prefill is routed by load and affinity only
        self.detokenize = detokenize  # text of a partly duplicated event's new tokens
        self.in_flight = 0

    def ready(self) -> bool:
        return self.nc.is_connected and bool(self.table.live(Role.PREFILL)) and bool(self.table.live(Role.DECODE))

    async def stream(self, req: GenerationRequest, usage: Usage | None = None) -> AsyncIterator[TokenEvent]:
        """Ordered, deduplicated events of `req`; `usage` (if given) is filled as they arrive."""
        from kvmesh.ingress.supervisor import (
            RequestRun,  # one module per concept; no import cycle at load
        )

        if self.in_flight >= self.settings.max_in_flight:
            raise GatewayError(ErrorKind.OVERLOADED, f"too many requests in flight ({self.in_flight})")
        usage = usage if usage is not None else Usage()
        usage.pins = req.pins
        run = RequestRun(self, req, usage)
        self.in_flight += 1
        try:
            async for event in run.events():
                yield event
        finally:
            self.in_flight -= 1
            # shielded: a cancelled client task must still unsubscribe and send the abort
            await asyncio.shield(run.close())

    async def complete(self, req: GenerationRequest) -> Completion:
        usage = Usage()
        ids: list[int] = []
        text: list[str] = []
        finish = "stop"
        async for event in self.stream(req, usage):
            ids += event.token_ids
            text.append(event.text)
            if event.finished:
                finish = event.finish_reason or "stop"
        return Completion(ids, "".join(text), finish, usage.prompt_tokens, usage.cached_tokens,
                          usage.cache_created_tokens, usage)
