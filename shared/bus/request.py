"""Typed request/reply over core NATS: a request model in, a reply model out, always a timeout.

Failures are typed so callers can degrade (design: "every hop has a timeout"):
`RequestTimeout` (nobody answered in time), `NoResponders` (nobody listens on
the subject), `RemoteError` (the responder's handler failed; it answered an
`ErrorReply`). The serving side runs handlers in a queue group, so replicas of
a service share the load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import nats.errors
from kvmesh.log import (
    bind_request,
    fields_from_headers,
    get_logger,
    propagation_headers,
)
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol import subjects
from kvmesh.protocol.base import Message, ProtocolError
from kvmesh.protocol.messages import ErrorReply
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = get_logger(__name__)

Req = TypeVar("Req", bound=Message)
Rep = TypeVar("Rep", bound=Message)


class RequestError(RuntimeError):
    """A request that got no usable reply; `retriable` says whether trying again may help."""

    retriable = True


class RequestTimeout(RequestError):
    def __init__(self, subject: str, timeout_s: float) -> None:
        super().__init__(f"request to {subject} timed out after {timeout_s:.3g}s (no reply)")
        self.subject, self.timeout_s = subject, timeout_s


class NoResponders(RequestError):
    def __init__(self, subject: str) -> None:
        super().__init__(f"request to {subject}: no responders (is the service running?)")
        self.subject = subject


class RemoteError(RequestError):
    def __init__(self, subject: str, reply: ErrorReply) -> None:
        super().__init__(f"request to {subject} failed remotely: {reply.error}")
        self.subject, self.retriable = subject, reply.retriable


async def request(
    nc: NATS,
    subject: str,
    payload: Message,
    reply_model: type[Rep],
    timeout_s: float,
    metrics: ServiceMetrics | None = None,
) -> Rep:
    """Send `payload`, wait up to `timeout_s` for one reply, decode it as `reply_model`."""
    try:
        msg = await nc.request(subject, payload.to_bytes(), timeout=timeout_s, headers=propagation_headers() or None)
    except nats.errors.NoRespondersError as exc:
        _count(metrics, subject)
        raise NoResponders(subject) from exc
    except (nats.errors.TimeoutError, asyncio.TimeoutError) as exc:
        _count(metrics, subject)
        raise RequestTimeout(subject, timeout_s) from exc
    if (msg.headers or {}).get(subjects.HDR_REPLY_STATUS) == "error":
        _count(metrics, subject)
        raise RemoteError(subject, ErrorReply.from_bytes(msg.data))
    return reply_model.from_bytes(msg.data)


@dataclass(slots=True)
class Responder:
    """A serving endpoint: up to `max_concurrent` handlers run at once; `drain()` finishes them."""

    sub: Subscription
    running: set[asyncio.Task[None]] = field(default_factory=set)

    async def drain(self) -> None:
        """Stop taking requests, answer the ones already received."""
        await self.sub.drain()
        if self.running:
            await asyncio.wait(set(self.running))


async def serve(
    nc: NATS,
    subject: str,
    request_model: type[Req],
    handler: Callable[[Req], Awaitable[Message]],
    queue: str,
    max_concurrent: int = 64,
) -> Responder:
    """Answer requests on `subject` with `handler`, in queue group `queue`.

    A request that does not decode is answered with a non-retriable ErrorReply; a
    handler exception with a retriable one. Handlers run concurrently (nats-py would
    otherwise run one callback at a time per subscription), at most `max_concurrent`.
    """
    slots = asyncio.Semaphore(max_concurrent)

    async def answer(msg: Msg) -> None:
        try:
            with bind_request(**fields_from_headers(msg.headers)):
                reply = await handler(request_model.from_bytes(msg.data))
                await msg.respond(reply.to_bytes())
        except ProtocolError as exc:
            await _respond_error(nc, msg, ErrorReply(error=str(exc), retriable=False))
        except Exception as exc:  # noqa: BLE001 - the caller gets the error instead of a timeout
            log.warning("request handler failed", subject=subject, error=repr(exc))
            await _respond_error(nc, msg, ErrorReply(error=repr(exc), retriable=True))
        finally:
            slots.release()

    async def on_msg(msg: Msg) -> None:
        if not msg.reply:
            return
        await slots.acquire()  # backpressure: the subscription's queue holds the rest
        task = asyncio.create_task(answer(msg))
        responder.running.add(task)
        task.add_done_callback(responder.running.discard)

    responder = Responder(await nc.subscribe(subject, queue=queue, cb=on_msg))
    return responder


async def _respond_error(nc: NATS, msg: Msg, reply: ErrorReply) -> None:
    await nc.publish(msg.reply, reply.to_bytes(), headers={subjects.HDR_REPLY_STATUS: "error"})


def _count(metrics: ServiceMetrics | None, subject: str) -> None:
    if metrics is not None:
        metrics.requests_failed.labels(subjects.family(subject)).inc()
