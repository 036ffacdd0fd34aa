"""Connect to NATS with reconnects that never give up and callbacks that log.

Once connected, the client retries forever with exponential backoff (min..max
from `BusSettings`, jittered so a fleet does not reconnect in lockstep),
always trying the server it has failed on least. Publishes made while
reconnecting are buffered by nats-py and flushed on reconnect; JetStream
publishes are additionally retried by `kvmesh.bus.publish`. The first connect
is retried too (NATS may still be starting) but only for
`connect_retry_total_s`; then `ConnectionError` says which URL never answered.
With a `ClientAuth` the process connects as its NATS user (credentials in
the URLs, optional TLS, its own reply-inbox prefix); a refused login is
retried like an unreachable server, then reported as such.

nats-py ends a connection for good on any `-ERR` the server sends once
connected (but a permissions one); the server itself closes the link after
most of them. A service with a closed connection is a zombie that never gets
ready again, so here such an error is a broken link to reconnect over, like a
stale connection. A refused login (credentials revoked) still closes it.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from kvmesh.bus.client_auth import ClientAuth, connect_kwargs
from kvmesh.config import BusSettings
from kvmesh.log import get_logger
from kvmesh.retry import Backoff
from nats.aio.client import AUTHORIZATION_VIOLATION, PERMISSIONS_ERR, Server
from nats.aio.client import Client as NATS

log = get_logger(__name__)


class _Client(NATS):
    """nats-py's client, except that a server error on an open connection reconnects (module docstring)."""

    async def _process_err(self, err_msg: str) -> None:
        if self.is_connecting or PERMISSIONS_ERR in err_msg or AUTHORIZATION_VIOLATION in err_msg:
            await super()._process_err(err_msg)
            return
        error = nats.errors.Error(f"nats: {err_msg.strip(chr(39))}")
        await self._error_cb(error)
        await self._process_op_err(error)


@dataclass(slots=True)
class _Hooks:
    """nats-py callbacks of one connection: log each state change, pick servers with backoff."""

    name: str
    settings: BusSettings
    nc: NATS
    rng: random.Random = field(default_factory=random.Random)  # jitter only; nothing is derived from it
    last_error: Exception | None = None  # said when the first connect gives up
    refusal: Exception | None = None  # the server refused our credentials: said instead, being the cause
    backoff: Backoff = field(init=False)  # the wait before a server's next reconnect, by its reconnects so far

    def __post_init__(self) -> None:
        s = self.settings
        self.backoff = Backoff(s.reconnect_wait_min_s, s.reconnect_wait_max_s, jitter=0.5, rng=self.rng)

    def pick_server(self, pool: list[Server], _info: dict[str, Any]) -> tuple[Server, float]:
        server = min(pool, key=lambda s: s.reconnects)
        return server, self.backoff.delay(server.reconnects)

    def server(self) -> str:
        """host:port only: the URL itself carries the password."""
        url = self.nc.connected_url
        return f"{url.hostname}:{url.port}" if url else ""

    async def on_error(self, exc: Exception) -> None:
        self.last_error = exc
        if AUTHORIZATION_VIOLATION.lower() in str(exc).lower():  # a later reset of a refused client hides it
            self.refusal = exc
        log.warning("nats error", connection=self.name, error=repr(exc))

    async def on_disconnected(self) -> None:
        closing = self.nc.is_closed or self.nc.is_draining
        (log.info if closing else log.warning)("nats disconnected", connection=self.name)

    async def on_reconnected(self) -> None:
        log.info("nats reconnected", connection=self.name, server=self.server())

    async def on_closed(self) -> None:
        why = self.nc.last_error  # what the server said when it, not we, ended the connection
        log.info("nats connection closed", connection=self.name, error=repr(why) if why else None)


async def connect(url: str, name: str, settings: BusSettings | None = None, auth: ClientAuth | None = None) -> NATS:
    """An open connection to `url` (comma-separated URLs for a cluster), as `auth`'s user when given."""
    settings = settings or BusSettings()
    nc = _Client()
    hooks = _Hooks(name, settings, nc)
    try:
        await asyncio.wait_for(
            nc.connect(
                **connect_kwargs(url, auth),
                name=name,
                connect_timeout=settings.connect_timeout_s,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=settings.reconnect_wait_max_s,  # used by the first connect only
                reconnect_to_server_handler=hooks.pick_server,
                error_cb=hooks.on_error,
                disconnected_cb=hooks.on_disconnected,
                reconnected_cb=hooks.on_reconnected,
                closed_cb=hooks.on_closed,
            ),
            timeout=settings.connect_retry_total_s,
        )
    except TimeoutError:
        await nc.close()
        if hooks.refusal is not None:
            why = f" (refused: {hooks.refusal!r})"
        else:
            why = f" (last error: {hooks.last_error!r})" if hooks.last_error else ""
        where = ",".join(ClientAuth().server_url(u) for u in url.split(",") if u.strip())  # without credentials
        raise ConnectionError(
            f"NATS at {where} did not answer within {settings.connect_retry_total_s:.0f}s{why}") from None
    log.info("nats connected", connection=name, server=hooks.server())
    return nc


async def close(nc: NATS, drain: bool = False) -> None:
    """Drain (flush, finish subscriptions) or close `nc`; a link that is already gone is not an error here.

    nats-py raises from close() when the socket died underneath (e.g. NATS is down at
    shutdown); there is nothing left to flush then, so it is logged, not raised.
    """
    if nc.is_closed:
        return
    try:
        await (nc.drain() if drain and nc.is_connected else nc.close())
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        log.warning("nats close on a broken link", error=repr(exc))
        if not nc.is_closed:
            try:
                await nc.close()
            except OSError:
                pass
