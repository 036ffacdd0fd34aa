"""JetStream publish with a message id and a bounded retry that rides out a leader election.

Every publish carries `Nats-Msg-Id`, so a retry after a lost ack (or a
handler run twice) is dropped by the stream's duplicate window instead of
stored twice. Transient failures (timeout, no responders, 503 while a stream
leader is elected, connection lost or reconnecting) are retried with exponential
backoff until `publish_retry_total_s` has passed; then the last error
propagates. Permanent errors (a 400 such as a too-large message, or a
closed connection) propagate at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import nats.errors
from kvmesh.config import BusSettings
from kvmesh.log import get_logger, propagation_headers
from kvmesh.metrics import ServiceMetrics
from kvmesh.protocol import subjects
from kvmesh.protocol.base import Message
from kvmesh.retry import Backoff
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

log = get_logger(__name__)

_TRANSIENT: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    asyncio.TimeoutError,
    nats.errors.NoRespondersError,
    NoStreamResponseError,
    ServiceUnavailableError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    ConnectionError,  # the socket dropped under the request (server restart); nats-py reconnects
)


class PublishError(RuntimeError):
    """A publish that did not get a stream ack within the retry budget (the cause is chained)."""


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: the stream may answer once a leader is elected or the link is back."""
    if isinstance(exc, _TRANSIENT):
        return True
    # 5xx from the JetStream API (e.g. 503 "JetStream system temporarily unavailable").
    return isinstance(exc, APIError) and exc.code is not None and int(exc.code) >= 500


@dataclass(slots=True)
class Publisher:
    """Publishes messages to JetStream for one service; stateless apart from its collaborators."""

    js: JetStreamContext
    settings: BusSettings
    metrics: ServiceMetrics | None = None

    async def publish(
        self,
        subject: str,
        payload: Message | bytes,
        msg_id: str,
        headers: dict[str, str] | None = None,
        msg_ttl_s: float | None = None,
    ) -> api.PubAck:
        """Store `payload` under `subject` once (dedup by `msg_id`); returns the stream's ack.

        The request/session ids bound in the caller's log context ride along as headers.

        `msg_id` must be derived from the content's identity (request id + step,
        block hash ...), never random per attempt, or deduplication cannot work.
        """
        if not msg_id:
            raise ValueError("msg_id is required: it is what makes retries idempotent")
        data = payload.to_bytes() if isinstance(payload, Message) else bytes(payload)
        hdrs = {**propagation_headers(), **(headers or {}), subjects.HDR_MSG_ID: msg_id}
        s = self.settings
        deadline = time.monotonic() + s.publish_retry_total_s
        backoff = Backoff(s.publish_retry_min_s, s.publish_retry_max_s)
        attempt = 0
        while True:
            attempt += 1
            try:
                # A fresh dict each attempt: nats-py adds its own headers to the one it is given.
                return await self.js.publish(
                    subject, data, timeout=s.publish_timeout_s, headers=dict(hdrs), msg_ttl=msg_ttl_s
                )
            except Exception as exc:
                remaining = deadline - time.monotonic()
                if not is_transient(exc):
                    raise
                if remaining <= 0:
                    raise PublishError(
                        f"publish to {subject} (msg id {msg_id}) failed after {attempt} attempts "
                        f"in {s.publish_retry_total_s:.0f}s: {exc!r}"
                    ) from exc
                if self.metrics is not None:
                    self.metrics.publish_retries.labels(subjects.family(subject)).inc()
                log.info("publish retry", subject=subject, msg_id=msg_id, attempt=attempt, error=repr(exc))
                await asyncio.sleep(min(backoff.next(), remaining))

    @property
    def nc(self) -> NATS:
        """The connection under the JetStream context (for core requests and subscriptions)."""
        return self.js._nc

    async def send(self, subject: str, payload: Message, msg_id: str) -> None:
        """Publish without waiting for the stream's ack (core NATS; a stream on `subject` still stores
        it, deduplicated by `msg_id`). For the latency path where the reader copes with a lost message."""
        hdrs = {**propagation_headers(), subjects.HDR_MSG_ID: msg_id}
        await self.nc.publish(subject, payload.to_bytes(), headers=hdrs)
