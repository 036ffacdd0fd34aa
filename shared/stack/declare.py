"""Declare every stream, consumer and KV bucket on the stack's NATS (create-or-update).

This is the one place `kvmesh up` touches JetStream definitions; what they
are lives in ``shared.protocol.streams``.
"""

from __future__ import annotations

import asyncio

from shared.stack.errors import ExitCode, StackError


def declare_streams(nats_url: str, replicas: int, timeout_s: float = 30.0) -> None:
    try:
        asyncio.run(asyncio.wait_for(_declare(nats_url, replicas), timeout_s))
    except Exception as exc:  # noqa: BLE001 - connection, timeout or JetStream API errors alike
        raise StackError(ExitCode.START_FAILED, f"declaring streams on {nats_url} failed: {exc!r}") from None


async def _declare(nats_url: str, replicas: int) -> None:
    import nats
    from shared.protocol.streams import declare_all

    nc = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=2, allow_reconnect=False)
    try:
        await declare_all(nc.jetstream(), replicas=replicas)
    finally:
        await nc.close()
