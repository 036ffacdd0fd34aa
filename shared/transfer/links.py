"""Where peer-fetch bytes travel: a lean wire to the same server when it allows one, else nats-py.

Both kinds offer the same three things: `publish(subject, parts, reply)` of
one message made of buffers, `subscribe(subject, handler)` with a handler
called as `handler(subject, payload)` (payload None = 503 no responders),
and `max_payload`. `open_link` tries a `NatsWire` to the server the service
is connected to and falls back to the service's own nats-py connection when
the server needs TLS or auth, or the socket cannot be opened; a wire's
`closed` event says when it must be replaced (nats-py reconnects by itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from kvmesh.log import get_logger
from kvmesh.transfer.nats_wire import Handler, NatsWire, WireUnsupported
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

log = get_logger(__name__)


class Link(Protocol):
    max_payload: int
    closed: asyncio.Event

    async def publish(self, subject: str, parts: Sequence, reply: str = "") -> None: ...
    async def subscribe(self, subject: str, handler: Handler) -> None: ...
    async def close(self) -> None: ...


class NatsPyLink:
    """The service's nats-py connection, shared: closing the link only drops its subscriptions.

    `temporary`: taken because a wire could not be opened just now (the server restarting), not
    because the server refuses wires; its user drops it when idle so the next transfer tries again.
    """

    def __init__(self, nc: NATS, temporary: bool = False) -> None:
        self.nc = nc
        self.temporary = temporary
        self.closed = asyncio.Event()  # never set: nats-py reconnects on its own
        self._subs: list = []

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    async def publish(self, subject: str, parts: Sequence, reply: str = "") -> None:
        await self.nc.publish(subject, b"".join(parts), reply=reply)

    async def subscribe(self, subject: str, handler: Handler) -> None:
        async def on_msg(msg: Msg) -> None:  # a status message has no data: 503 no responders
            await handler(msg.subject, msg.data if msg.data else None)

        self._subs.append(await self.nc.subscribe(subject, cb=on_msg))

    async def close(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs = []


async def open_link(nc: NATS, name: str, use_wire: bool = True) -> Link:
    """A wire to `nc`'s current server, or `nc` itself where a wire cannot be had."""
    if not use_wire:
        return NatsPyLink(nc)
    if nc.connected_url is None:  # reconnecting
        return NatsPyLink(nc, temporary=True)
    try:
        return await NatsWire.connect(nc.connected_url.geturl(), name)
    except WireUnsupported as exc:
        log.info("peer data stays on nats-py", reason=str(exc))
        return NatsPyLink(nc)
    except (OSError, TimeoutError) as exc:
        log.info("peer data on nats-py for now", reason=repr(exc))
        return NatsPyLink(nc, temporary=True)
