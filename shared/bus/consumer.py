"""A durable pull-consumer loop: fetch, handle, ack; nak and retry; dead-letter poison.

Contract for a handler `async (msg) -> None`:
- returns: the message is acked.
- raises `PermanentError` or a `ProtocolError` (undecodable bytes): it is
  dead-lettered at once; retrying cannot help.
- raises anything else, or runs past the consumer's `handler_timeout_s`: it
  is nak'ed with a delay and redelivered, up to the consumer's `max_deliver`
  attempts; the failure of the last attempt dead-letters it. A message whose
  attempts died with their process (no verdict at all) is dead-lettered when
  it comes back once more.
Dead-lettering copies the payload to `subjects.dead_letter(stream)` with the
reason, delivery count, original subject, stream and sequence in headers,
then `term()`s the original (the copy's msg id is stream + sequence, so a
repeat is stored once). Handlers must be idempotent: JetStream delivers at
least once. The message's request/session ids are bound for their logs.
While a handler runs, `in_progress()` is sent every third of `ack_wait`, so
a long handler is not redelivered behind its back.

`stop()` stops fetching (a per-worker consumer's long idle pull is cut short;
a shared queue's pull of `bus.fetch_timeout_s` runs out and what it took is
nak'ed); `run()` then waits for in-flight handlers until the drain deadline,
cancels what is left (those messages are nak'ed for prompt redelivery
elsewhere) and returns. A per-worker consumer (`spec.per_worker`)
is declared with `bus.worker_consumer_inactive_s` as its inactive threshold
and deleted after a clean stop (not when the loop is cancelled or the
process dies: the threshold removes those); its messages stay in their
work-queue stream. A consumer that vanished under a running loop (expired
during a long partition, deleted by hand) is declared again at the next
failed fetch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import nats.errors
from kvmesh.bus.publish import Publisher, PublishError
from kvmesh.config import BusSettings
from kvmesh.log import bind_request, fields_from_headers, get_logger
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol import subjects
from kvmesh.protocol.base import Message, ProtocolError
from kvmesh.protocol.streams import ConsumerSpec, declare_consumer
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError, ServiceUnavailableError

log = get_logger(__name__)

Handler = Callable[[Msg], Awaitable[None]]
M = TypeVar("M", bound=Message)

_MAX_REASON_CHARS = 1000


class PermanentError(Exception):
    """Raised by a handler for a message that can never succeed: dead-letter it now."""


def typed(model: type[M], fn: Callable[[M, Msg], Awaitable[None]]) -> Handler:
    """A handler that decodes the payload as `model` first (a decode failure is permanent)."""

    async def handler(msg: Msg) -> None:
        await fn(model.from_bytes(msg.data), msg)

    return handler


@dataclass(slots=True)
class ConsumerLoop:
    """Runs one durable pull consumer until stopped; see the module docstring for the contract."""

    js: JetStreamContext
    spec: ConsumerSpec
    handler: Handler
    publisher: Publisher
    metrics: ServiceMetrics
    settings: BusSettings = field(default_factory=BusSettings)
    drain_timeout_s: float = 10.0
    _stopping: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _ready: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _inflight: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    @property
    def in_flight(self) -> int:
        """Messages taken from the stream and not yet settled (a natural `load` for a heartbeat)."""
        return len(self._inflight)

    @property
    def ready(self) -> bool:
        """True once the consumer is declared and bound, until it stops."""
        return self._ready.is_set() and not self._stopping.is_set()

    async def wait_ready(self) -> None:
        await self._ready.wait()

    def stop(self) -> None:
        """Stop fetching; `run()` returns once in-flight handlers are done or the deadline passed."""
        self._stopping.set()

    async def run(self) -> None:
        await self._declare()
        sub = await self.js.pull_subscribe_bind(durable=self.spec.durable, stream=self.spec.stream)
        self._ready.set()
        log.info("consumer started", stream=self.spec.stream, durable=self.spec.durable)
        try:
            await self._fetch_loop(sub)
        finally:
            self._ready.clear()  # /readyz must not report a consumer that is no longer fetching
            await self._drain_inflight()
            await sub.unsubscribe()
            log.info("consumer stopped", stream=self.spec.stream, durable=self.spec.durable)
        # reached after a clean stop only: a cancelled loop (abrupt end) leaves its consumer to the threshold
        if self.spec.per_worker:
            await self._delete()

    async def _declare(self) -> None:
        threshold = self.settings.worker_consumer_inactive_s if self.spec.per_worker else None
        await declare_consumer(self.js, self.spec, threshold)

    async def _delete(self) -> None:
        """Delete this worker's consumer; best effort (a user without the permission, a bus already gone)."""
        try:
            await asyncio.wait_for(self.js.delete_consumer(self.spec.stream, self.spec.durable),
                                   self.settings.request_timeout_s)
            log.info("consumer deleted", stream=self.spec.stream, durable=self.spec.durable)
        except NotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001 - the inactive threshold removes it anyway
            log.info("consumer not deleted, left to the inactive threshold", durable=self.spec.durable,
                     error=repr(exc))

    async def _fetch_loop(self, sub: JetStreamContext.PullSubscription) -> None:
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await self._fetch_until_stopped(sub, stopping)
        finally:
            stopping.cancel()

    async def _fetch_until_stopped(self, sub: JetStreamContext.PullSubscription, stopping: asyncio.Future) -> None:
        batch = max(1, self.spec.max_handlers or self.settings.fetch_batch)
        poll = self.settings.worker_fetch_timeout_s if self.spec.per_worker else self.settings.fetch_timeout_s
        while not self._stopping.is_set():
            free = batch - len(self._inflight)
            if free <= 0:
                await asyncio.wait({*self._inflight, stopping}, return_when=asyncio.FIRST_COMPLETED)
                continue
            fetch = asyncio.ensure_future(sub.fetch(free, timeout=poll))
            fetch.add_done_callback(_seen)  # a pull abandoned (stop, cancel) may still end in its own error
            try:
                await asyncio.wait({fetch, stopping}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                fetch.cancel()
                raise
            if not fetch.done() and self.spec.per_worker:
                # Stopped during a long idle pull: the consumer is deleted next, and what the pull might
                # still take stays in the work-queue stream for the next consumer of this worker's subject.
                fetch.cancel()
                await asyncio.wait({fetch})
                break
            try:
                msgs = await fetch  # a shared queue's short pull runs out: what it took is nak'ed below
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except Exception as exc:  # reconnecting, leader change...: wait a little and fetch again
                if self._stopping.is_set():
                    break
                log.warning("fetch failed", durable=self.spec.durable, error=repr(exc))
                await asyncio.sleep(min(1.0, poll))
                if isinstance(exc, (ServiceUnavailableError, nats.errors.NoRespondersError)):
                    await self._redeclare()  # no one answers pulls: the consumer may be gone
                continue
            for msg in msgs:
                if self._stopping.is_set():
                    await _quietly(msg.nak())  # fetched while stopping: give it back for prompt redelivery
                    continue
                task = asyncio.create_task(self._guarded(msg))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)

    async def _redeclare(self) -> None:
        try:
            await self._declare()
        except Exception as exc:  # noqa: BLE001 - still no JetStream (leader election): the next fetch retries
            log.warning("consumer not declared again", durable=self.spec.durable, error=repr(exc))

    async def _drain_inflight(self) -> None:
        if not self._inflight:
            return
        pending = set(self._inflight)
        _, left = await asyncio.wait(pending, timeout=self.drain_timeout_s)
        for task in left:
            task.cancel()
        if left:
            log.warning("drain deadline passed, cancelled handlers", durable=self.spec.durable, count=len(left))
            await asyncio.wait(left)

    async def _guarded(self, msg: Msg) -> None:
        # The handler's logs (and what it publishes) carry the message's request/session ids.
        try:
            with bind_request(**fields_from_headers(msg.headers), subject=msg.subject):
                await self._handle(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - settling failed (link down): the server redelivers
            log.warning("could not settle message", subject=msg.subject, error=repr(exc))

    async def _handle(self, msg: Msg) -> None:
        md = msg.metadata
        label = self.spec.filter_subject
        deliveries = md.num_delivered
        if deliveries > 1:
            self.metrics.messages_redelivered.labels(label).inc()
        if deliveries > self.spec.max_deliver:
            await self._dead_letter(msg, f"no verdict after {deliveries - 1} deliveries (handler died or hung)")
            return
        keepalive = asyncio.create_task(self._keep_alive(msg))
        in_flight = self.metrics.messages_in_flight.labels(label)
        in_flight.inc()
        start = time.perf_counter()
        deadline = asyncio.timeout(self.spec.handler_timeout_s)
        try:
            async with deadline:
                await self.handler(msg)
        except asyncio.CancelledError:
            await _quietly(msg.nak())
            raise
        except (PermanentError, ProtocolError) as exc:
            self.metrics.messages_failed.labels(label).inc()
            await self._dead_letter(msg, f"permanent: {exc!r}")
        except Exception as exc:
            self.metrics.messages_failed.labels(label).inc()
            error = f"handler timed out after {self.spec.handler_timeout_s}s" if deadline.expired() else repr(exc)
            if deliveries >= self.spec.max_deliver:
                await self._dead_letter(msg, f"failed {deliveries} times, last: {error}")
            else:
                log.warning("handler failed, will retry", durable=self.spec.durable, subject=msg.subject,
                            deliveries=deliveries, error=error)
                await msg.nak(delay=self.settings.nak_delay_s)
        else:
            await self._ack(msg)
            self.metrics.messages_handled.labels(label).inc()
        finally:
            keepalive.cancel()
            in_flight.dec()
            self.metrics.handler_seconds.labels(label).observe(time.perf_counter() - start)

    async def _ack(self, msg: Msg) -> None:
        # Confirmed ack: once run() returns after a drain, every finished message is settled
        # on the server. A lost ack only means one redelivery (handlers are idempotent).
        try:
            await msg.ack_sync(timeout=self.settings.publish_timeout_s)
        except Exception as exc:  # noqa: BLE001
            log.warning("ack not confirmed, message may be redelivered", subject=msg.subject, error=repr(exc))

    async def _keep_alive(self, msg: Msg) -> None:
        interval = max(0.1, self.spec.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            await _quietly(msg.in_progress())

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        md = msg.metadata
        reason = " ".join(reason.split())[:_MAX_REASON_CHARS]  # one header line
        headers = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}
        headers.update({
            subjects.HDR_DLQ_REASON: reason,
            subjects.HDR_DLQ_DELIVERIES: str(md.num_delivered),
            subjects.HDR_DLQ_SUBJECT: msg.subject,
            subjects.HDR_DLQ_STREAM: md.stream,
            subjects.HDR_DLQ_STREAM_SEQ: str(md.sequence.stream),
            subjects.HDR_DLQ_CONSUMER: md.consumer,
        })
        try:
            await self.publisher.publish(
                subjects.dead_letter(md.stream), msg.data,
                msg_id=f"dlq-{md.stream}-{md.sequence.stream}", headers=headers,
            )
        except PublishError as exc:
            # Not copied: leave the message to the server (one more delivery at most) rather than lose it here.
            log.error("dead-letter publish failed", durable=self.spec.durable, error=repr(exc))
            await _quietly(msg.nak(delay=self.settings.nak_delay_s))
            return
        await msg.term()
        self.metrics.messages_dead_lettered.labels(self.spec.filter_subject).inc()
        log.error("message dead-lettered", durable=self.spec.durable, subject=msg.subject,
                  stream_seq=md.sequence.stream, deliveries=md.num_delivered, reason=reason)


def _seen(fetch: asyncio.Future) -> None:
    """Mark a pull's outcome as retrieved: one left behind by a stop is not asyncio's "never retrieved" error."""
    if not fetch.cancelled():
        fetch.exception()


async def _quietly(aw: Awaitable[None]) -> None:
    """Acks on a broken link fail; the server's ack_wait covers them, so don't let them mask the real error."""
    try:
        await aw
    except Exception as exc:  # noqa: BLE001
        log.debug("ack-type reply failed", error=repr(exc))
