"""The gateway: a validated request in, an ordered token stream out (one per ingress process).

A dialect builds a `GenerationRequest` (shared/ingress/dialects/common.py) and
iterates `Gateway.stream(req)`; named-cache creation awaits `Gateway.complete(req)`. The stream
yields `TokenEvent`s in seq order without duplicates, each holding only
tokens the caller has not seen; the last has `finished=True`. Failures that
supervision cannot repair raise `GatewayError` (never a silent short stream).
Leaving the iteration early (client gone) aborts the request on its worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from kvmesh.bus.publish import Publisher
from kvmesh.config import IngressSettings
from kvmesh.ingress.core.errors import ErrorKind
from kvmesh.ingress.core.types import Completion, GatewayError, GenerationRequest, Usage
from kvmesh.ingress.routing.placement import PlacementCosts
from kvmesh.ingress.routing.prefix_locator import PrefixLocator
from kvmesh.ingress.routing.router import Router
from kvmesh.ingress.routing.workers import WorkerTable
from kvmesh.ingress.supervision.request_run import RequestRun
from kvmesh.protocol.messages import Role
from kvmesh.protocol.serving import TokenEvent
from nats.aio.client import Client as NATS


class Gateway:
    """Runs requests over the bus; one per ingress process."""

    def __init__(self, nc: NATS, publisher: Publisher, table: WorkerTable, settings: IngressSettings,
                 detokenize: Callable[[Sequence[int]], str], on_retry: Callable[[], None] = lambda: None,
                 locator: PrefixLocator | None = None, on_stale_event: Callable[[], None] = lambda: None) -> None:
        self.nc, self.publisher, self.table, self.settings = nc, publisher, table, settings
        self.on_retry = on_retry  # counts prefill retries and decode migrations
        self.on_stale_event = on_stale_event  # counts token events of replaced attempts, dropped unseen
        self.router = Router.of(table, settings)
        self.placement = PlacementCosts.of(settings)  # where each request decodes (routing/placement.py)
        self.locator = locator  # None: prefill is routed by load and affinity only
        self.detokenize = detokenize  # text of a partly duplicated event's new tokens
        self.in_flight = 0

    def ready(self) -> bool:
        """Connected, a live prefill worker, and one to decode on: a decode worker, or (placement "local", or
        "priced", which decodes on the prefill worker when no decode worker lives) the prefill workers themselves."""
        decodes = self.placement.mode != "split" or bool(self.table.live(Role.DECODE))
        return self.nc.is_connected and bool(self.table.live(Role.PREFILL)) and decodes

    async def stream(self, req: GenerationRequest, usage: Usage | None = None) -> AsyncIterator[TokenEvent]:
        """Ordered, deduplicated events of `req`; `usage` (if given) is filled as they arrive."""
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
