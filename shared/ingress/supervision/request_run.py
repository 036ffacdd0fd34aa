"""One request's life on the bus: publish, watch, retry, migrate, deliver in order.

The run subscribes to the request's token subject BEFORE it publishes the
PrefillJob. Two stages are watched, each with its own timeout and its
worker's heartbeat:
- prefill (until seq 0 arrives): the prefill worker gone or silent past
  `first_token_timeout_s` -> the PrefillJob is published again (attempt+1)
  to another prefill worker;
- decode (after seq 0): the decode worker gone or silent past
  `inter_token_timeout_s` -> a migration DecodeJob (prompt + every token
  delivered so far, attempt+1) goes to another decode worker, which
  continues at seq = len(generated).
The decode worker of an attempt is the prefill worker itself where a
handoff does not pay (shared/ingress/routing/placement.py): that worker
then runs the request to its end, watched and migrated the same way.
Events are delivered by seq: a seq already delivered is dropped, one ahead
is buffered. Only the current attempt's events count: an older attempt's
(a replaced worker that still runs, e.g. paused and resumed) are dropped
and counted, whatever their seq, so a zombie can never splice its own
continuation into the stream; a migration also tells the replaced decode
attempt to stop (an attempt-scoped AbortRequest to its worker). Sampled
requests without a seed get one here, so every attempt draws the same
continuation (the workers skip the draws of the tokens already delivered).
A retriable error event also triggers a retry. After
`max_attempts` the run raises GatewayError; the caller ends the response
with an error status or an error event, never a silently short body.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from enum import StrEnum
from typing import Protocol

import nats.errors
from kvmesh.bus.publish import Publisher, PublishError
from kvmesh.cache_index.messages import LookupReply
from kvmesh.config import IngressSettings
from kvmesh.ingress.core.errors import ErrorKind
from kvmesh.ingress.core.types import GatewayError, GenerationRequest, Usage
from kvmesh.ingress.routing.placement import PlacementCosts, decode_here
from kvmesh.ingress.routing.prefix_locator import PrefixLocator
from kvmesh.ingress.routing.router import Router
from kvmesh.ingress.routing.workers import WorkerTable
from kvmesh.log import get_logger
from kvmesh.protocol import subjects
from kvmesh.protocol.base import ProtocolError
from kvmesh.protocol.messages import Role
from kvmesh.protocol.serving import AbortRequest, DecodeJob, PrefillJob, TokenEvent
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

log = get_logger(__name__)


class Stage(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class Wiring(Protocol):
    """What a run uses of its gateway (shared/ingress/supervision/gateway.py): the bus, the workers, the hooks."""

    nc: NATS
    publisher: Publisher
    table: WorkerTable
    router: Router
    locator: PrefixLocator | None
    placement: PlacementCosts
    settings: IngressSettings
    detokenize: Callable[[Sequence[int]], str]
    on_retry: Callable[[], None]
    on_stale_event: Callable[[], None]


class RequestRun:
    __slots__ = ("gw", "req", "usage", "attempt", "stage", "prefill_worker", "decode_worker", "next_seq",
                 "generated", "_pending", "_inbox", "_sub", "_finished", "_held", "_deadline", "_progress",
                 "_prefill_sent", "_local")

    def __init__(self, gw: Wiring, req: GenerationRequest, usage: Usage) -> None:
        if req.sampling.temperature > 0 and req.sampling.seed is None:
            # one seed for every attempt: a migrated attempt continues the draws instead of starting new ones
            req.sampling = req.sampling.model_copy(update={"seed": secrets.randbits(63)})
        self.gw, self.req, self.usage = gw, req, usage
        self.attempt = 0
        self.stage = Stage.PREFILL
        self.prefill_worker = ""
        self.decode_worker = ""
        self.next_seq = 0
        self.generated: list[int] = []
        self._pending: dict[int, TokenEvent] = {}
        self._inbox: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._sub = None
        self._finished = False
        self._held: list[str] = []  # workers whose in-flight count this run holds
        self._deadline = time.time() + gw.settings.request_deadline_s
        self._progress = time.monotonic()  # when the current attempt last delivered (or started)
        self._prefill_sent = 0.0  # when the current PrefillJob was published: seq 0 measures the worker's rate
        self._local = False  # the current attempt decodes on its prefill worker (no handoff)

    # --- lifecycle -------------------------------------------------------

    async def events(self) -> AsyncIterator[TokenEvent]:
        s = self.gw.settings
        self._sub = await self.gw.nc.subscribe(subjects.tokens(self.req.request_id), cb=self._on_msg)
        await self._start_prefill(exclude=())
        while True:
            timeout = s.first_token_timeout_s if self.stage is Stage.PREFILL else s.inter_token_timeout_s
            watched = self.prefill_worker if self.stage is Stage.PREFILL else self.decode_worker
            # measured from the last delivered token: events that only fill the out-of-order buffer
            # (a lost event left a gap) are not progress
            left = self._progress + timeout - time.monotonic()
            event = await self._next(watched, left) if left > 0 else None
            if event is None:
                await self._recover(f"{self.stage} worker {watched} gone or silent for {timeout:.0f}s")
                continue
            if event.attempt != self.attempt:  # a replaced attempt (a zombie, or its late failure report)
                self.gw.on_stale_event()
                continue
            if event.error:
                if not event.retriable:
                    raise GatewayError(ErrorKind.INVALID_REQUEST, event.error, retriable=False)
                await self._recover(f"worker {event.worker_id} reported: {event.error}")
                continue
            for ready in self._accept(event):
                yield ready
                self._progress = time.monotonic()  # after the yield: a slow reader is not a stalled worker
                if ready.finished:
                    self._finished = True
                    return

    async def close(self) -> None:
        """Unsubscribe; if the request did not finish (client gone, error), tell its workers to stop.

        Before the first token the handoff may already be on its way, so both the prefill and the
        decode worker are told. Best effort: a bus that is gone cannot carry the abort anyway.
        """
        for worker in self._held:
            self.gw.table.release(worker)
        self._held.clear()
        try:
            if self._sub is not None:
                await self._sub.unsubscribe()
            if not self._finished and self.gw.nc.is_connected:
                before_handoff = self.stage is Stage.PREFILL
                workers = {self.prefill_worker, self.decode_worker} if before_handoff else {self.decode_worker}
                abort = AbortRequest(request_id=self.req.request_id).to_bytes()
                for worker in filter(None, workers):
                    await self.gw.nc.publish(subjects.abort(worker), abort)
        except nats.errors.Error as exc:
            log.warning("request cleanup incomplete", error=repr(exc))

    # --- events ----------------------------------------------------------

    async def _on_msg(self, msg: Msg) -> None:
        try:
            event = TokenEvent.from_bytes(msg.data)
        except ProtocolError as exc:
            log.warning("unreadable token event dropped", error=str(exc))
            return
        self._inbox.put_nowait(event)

    async def _next(self, watched: str, timeout: float) -> TokenEvent | None:
        """The next event, or None when `watched` goes down or nothing arrives within `timeout`."""
        gone = self.gw.table.gone(watched)
        if gone.is_set():
            return None
        get = asyncio.ensure_future(self._inbox.get())
        down = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({get, down}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            if not get.done():
                get.cancel()
        return get.result() if get.done() and not get.cancelled() else None

    def _accept(self, event: TokenEvent) -> list[TokenEvent]:
        """Events now deliverable in order: `event` trimmed to unseen tokens, then any buffered successors."""
        if event.seq > self.next_seq:
            self._pending.setdefault(event.seq, event)
            return []
        out: list[TokenEvent] = []
        current: TokenEvent | None = event
        while current is not None:
            fresh = self._trim(current)
            if fresh is not None:
                out.append(fresh)
                if fresh.finished:
                    break
            current = self._pending.pop(self.next_seq, None)
        return out

    def _trim(self, event: TokenEvent) -> TokenEvent | None:
        skip = self.next_seq - event.seq
        if skip < 0:
            self._pending.setdefault(event.seq, event)
            return None
        new = event.token_ids[skip:]
        if not new and not event.finished:
            return None  # all seen already
        if skip and skip > len(event.token_ids):
            return None
        self.usage.take(event)
        if skip:
            event = event.model_copy(update={"seq": self.next_seq, "token_ids": new,
                                             "text": self.gw.detokenize(new)})
        self.generated += new
        self.next_seq += len(new)
        if self.stage is Stage.PREFILL:
            self.stage = Stage.DECODE
            self.gw.router.rates.observe(self.prefill_worker, time.monotonic() - self._prefill_sent,
                                         self.usage.prompt_tokens - self.usage.cached_tokens)
        return event

    # --- recovery --------------------------------------------------------

    def _hold(self, worker: str) -> None:
        self.gw.table.acquire(worker)
        self._held.append(worker)

    def _choose(self, role: Role, exclude: tuple[str, ...]) -> str:
        worker = self.gw.router.pick(role, self.req.affinity_key, exclude)
        if worker is None:  # only the excluded one is live: better it than nothing
            worker = self.gw.router.pick(role, self.req.affinity_key)
        if worker is None:
            raise GatewayError(ErrorKind.OVERLOADED, f"no live {role} worker")
        return worker

    async def _choose_prefill(self, exclude: tuple[str, ...]) -> tuple[str, LookupReply | None]:
        """Where the prompt's prefix is cheapest to extend (cache index), else by load; see router.py.

        Also the index's answer (None: not asked, or no answer): who else holds the prefix, how far L3 does."""
        if self.gw.locator is None or self.gw.router.mode != "cost":
            return self._choose(Role.PREFILL, exclude), None
        req, block_size = self.req, self.gw.locator.block_size
        reply = await self.gw.locator.lookup(req.prompt_ids, req.tenant_salt, req.block_hashes)
        worker = self.gw.router.pick_prefill(len(req.prompt_ids), block_size, reply, req.affinity_key, exclude)
        return worker or self._choose(Role.PREFILL, exclude), reply

    async def _start_prefill(self, exclude: tuple[str, ...]) -> None:
        req = self.req
        self.prefill_worker, reply = await self._choose_prefill(exclude)
        prefix_worker = self.gw.router.prefix_holder(reply, self.prefill_worker, exclude)
        self._hold(self.prefill_worker)
        self._place_decode()
        job = PrefillJob(request_id=req.request_id, attempt=self.attempt, session_id=req.session_id,
                         tenant=req.tenant, tenant_salt=req.tenant_salt, prompt_ids=req.prompt_ids,
                         sampling=req.sampling, decode_worker=self.decode_worker, pins=req.pins,
                         prefill_only=req.prefill_only, deadline=self._deadline, prefix_worker=prefix_worker,
                         l3_blocks=reply.l3_blocks if reply is not None and reply.ready else None)
        self.usage.prefill_worker, self.usage.decode_worker = self.prefill_worker, self.decode_worker
        self._prefill_sent = time.monotonic()
        await self._publish(subjects.jobs_prefill(self.prefill_worker), job)
        if self.attempt == 0 and req.on_dispatched is not None:
            req.on_dispatched()

    def _place_decode(self) -> None:
        """The decode worker of this attempt: the prefill worker itself where a handoff does not pay
        (routing/placement.py; the PrefillJob then names its own worker for decode), else one by load,
        kept across prefill retries while it lives."""
        table = self.gw.table
        keep = bool(self.decode_worker) and not self._local and not table.gone(self.decode_worker).is_set()
        candidate = self.decode_worker if keep else self.gw.router.pick(Role.DECODE, self.req.affinity_key)
        block_size = self.gw.locator.block_size if self.gw.locator is not None else 16
        self._local = decode_here(self.gw.placement, table.view(self.prefill_worker),
                                  table.view(candidate) if candidate else None, len(self.req.prompt_ids),
                                  self.req.sampling.max_tokens, block_size)
        if self._local:
            self.decode_worker = self.prefill_worker
        elif not keep:
            self.decode_worker = candidate or self._choose(Role.DECODE, ())
            self._hold(self.decode_worker)

    async def _migrate(self) -> None:
        req = self.req
        replaced = self.decode_worker
        self._local = False
        self.decode_worker = self._choose(Role.DECODE, (replaced,))
        self._hold(self.decode_worker)
        job = DecodeJob(request_id=req.request_id, attempt=self.attempt, session_id=req.session_id,
                        tenant=req.tenant, tenant_salt=req.tenant_salt, prompt_ids=req.prompt_ids,
                        generated=list(self.generated), sampling=req.sampling,
                        prompt_tokens=len(req.prompt_ids), cached_tokens=self.usage.cached_tokens,
                        deadline=self._deadline)
        self.usage.decode_worker = self.decode_worker
        await self._stop_replaced(replaced)
        await self._publish(subjects.jobs_decode(self.decode_worker), job)

    async def _stop_replaced(self, worker: str) -> None:
        """Tell `worker` to stop the attempts before this one (core NATS, best effort: a paused worker reads
        it when it resumes, and the attempt filter fences it whether or not it does)."""
        abort = AbortRequest(request_id=self.req.request_id, attempt=self.attempt - 1, reason="migrated")
        try:
            await self.gw.nc.publish(subjects.abort(worker), abort.to_bytes())
        except nats.errors.Error as exc:
            log.warning("abort of the replaced attempt not sent", worker=worker, error=repr(exc))

    async def _publish(self, subject: str, job: PrefillJob | DecodeJob) -> None:
        """Publish with the idempotent msg id; a bus that stays down past the retry budget is a 503/529."""
        try:
            await self.gw.publisher.publish(subject, job, msg_id=f"{self.req.request_id}:{self.attempt}")
        except PublishError as exc:
            raise GatewayError(ErrorKind.OVERLOADED, f"cannot hand the job to the bus: {exc}") from exc

    async def _recover(self, reason: str) -> None:
        self.attempt += 1
        if self.attempt >= self.gw.settings.max_attempts or time.time() > self._deadline:
            raise GatewayError(ErrorKind.API, f"request did not finish after {self.attempt} attempts: {reason}")
        log.warning("retrying request", request_id=self.req.request_id, stage=self.stage,
                    attempt=self.attempt, reason=reason)
        self.gw.on_retry()
        self.usage.attempts = self.attempt + 1
        self._progress = time.monotonic()
        self._pending.clear()  # buffered events of the replaced attempt: never delivered now
        if self.stage is Stage.PREFILL:
            await self._start_prefill(exclude=(self.prefill_worker,))
        else:
            await self._migrate()
