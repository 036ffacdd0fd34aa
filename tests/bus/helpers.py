"""Helpers for bus and service tests: a connected client with all streams declared, and condition waits."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from kvmesh.bus.connection import close, connect
from kvmesh.config import BusSettings
from kvmesh.protocol.streams import declare_all
from nats.aio.client import Client as NATS
from waits import until

# Short deadlines so failing tests fail fast.
FAST_BUS = BusSettings(
    connect_timeout_s=2.0, reconnect_wait_min_s=0.05, reconnect_wait_max_s=0.5,
    publish_timeout_s=1.0, publish_retry_total_s=20.0, publish_retry_min_s=0.05, publish_retry_max_s=0.5,
    request_timeout_s=1.0, nak_delay_s=0.1, fetch_batch=4, fetch_timeout_s=0.5,
)


def unique(prefix: str = "t") -> str:
    """A subject-safe id unique to this test run (tests share one session server)."""
    return f"{prefix}{uuid.uuid4().hex[:10]}"


@asynccontextmanager
async def connected(url: str, name: str = "test") -> AsyncIterator[NATS]:
    nc = await connect(url, name, FAST_BUS)
    try:
        await declare_all(nc.jetstream())
        yield nc
    finally:
        await close(nc)


async def eventually(check: Callable[[], Awaitable[bool] | bool], timeout_s: float, what: str) -> None:
    """Poll `check` until true; fail with `what` after `timeout_s` (a deadline, never a fixed sleep)."""
    await until(check, timeout_s, what)
