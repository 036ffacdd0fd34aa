"""Connect to NATS with reconnects that never give up and callbacks that log.

The client retries forever with exponential backoff (min..max from
`BusSettings`, with jitter so a fleet does not reconnect in lockstep), always
trying the server it has failed on least. Publishes made while reconnecting
are buffered by nats-py and flushed on reconnect; JetStream publishes are
additionally retried by `shared.bus.publish`.
"""

from __future__ import annotations

import random
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.client import Server

from shared.config import BusSettings
from shared.log import get_logger

log = get_logger(__name__)


def reconnect_delay(attempts: int, settings: BusSettings, rng: random.Random) -> float:
    """Seconds to wait before reconnect attempt number `attempts` (0-based): doubling, capped, jittered."""
    base = min(settings.reconnect_wait_max_s, settings.reconnect_wait_min_s * (2 ** min(attempts, 16)))
    return base * (0.5 + rng.random() / 2)


async def connect(url: str, name: str, settings: BusSettings | None = None) -> NATS:
    """An open connection to `url` (comma-separated for a cluster); raises if the first connect fails."""
    settings = settings or BusSettings()
    rng = random.Random()  # jitter only; nothing is derived from it

    def pick_server(pool: list[Server], _info: dict[str, Any]) -> tuple[Server, float]:
        server = min(pool, key=lambda s: s.reconnects)
        return server, reconnect_delay(server.reconnects, settings, rng)

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", connection=name, error=repr(exc))

    async def on_disconnected() -> None:
        log.warning("nats disconnected", connection=name)

    async def on_reconnected() -> None:
        log.info("nats reconnected", connection=name, server=str(nc.connected_url.netloc if nc.connected_url else ""))

    async def on_closed() -> None:
        log.info("nats connection closed", connection=name)

    nc = NATS()
    await nc.connect(
        servers=[u.strip() for u in url.split(",") if u.strip()],
        name=name,
        connect_timeout=settings.connect_timeout_s,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_to_server_handler=pick_server,
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
        closed_cb=on_closed,
    )
    log.info("nats connected", connection=name, server=str(nc.connected_url.netloc if nc.connected_url else ""))
    return nc

