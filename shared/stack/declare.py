"""Declare every stream, consumer and KV bucket on the stack's NATS (create-or-update).

This is the one place `kvmesh up` touches JetStream definitions; what they
are lives in ``kvmesh.protocol.streams``. A fresh cluster answers JetStream
API calls only once it has elected a meta leader (and R3 streams only once
enough peers joined), so failures are retried until the deadline.
"""

from __future__ import annotations

import asyncio
import time

from kvmesh.bus.client_auth import ClientAuth, connect_kwargs
from kvmesh.stack.errors import ExitCode, StackError

RETRY_S = 0.25
CALL_TIMEOUT_S = 1.0  # per JetStream API call; short, so a retry follows soon after the meta leader is elected


def declare_streams(nats_url: str, replicas: int, timeout_s: float = 30.0, auth: ClientAuth | None = None) -> None:
    """nats_url may list a cluster's nodes, comma separated; `auth`: a user allowed to declare (admin)."""
    from kvmesh.protocol.streams import StreamConfigConflict

    try:
        asyncio.run(_declare(nats_url, replicas, time.monotonic() + timeout_s, auth))
    except StreamConfigConflict as exc:
        raise StackError(ExitCode.START_FAILED, str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - connection, timeout or JetStream API errors alike
        raise StackError(ExitCode.START_FAILED, f"declaring streams on {nats_url} failed: {exc!r}") from None


async def _declare(nats_url: str, replicas: int, deadline: float, auth: ClientAuth | None) -> None:
    import nats
    from kvmesh.protocol.streams import StreamConfigConflict, declare_all

    nc = await nats.connect(**connect_kwargs(nats_url, auth), connect_timeout=5, max_reconnect_attempts=2,
                            allow_reconnect=False)
    try:
        while True:
            try:
                await declare_all(nc.jetstream(timeout=CALL_TIMEOUT_S), replicas=replicas)
                return
            except StreamConfigConflict:
                raise  # permanent: retrying cannot help
            except (nats.errors.Error, TimeoutError):  # JetStream API errors and timeouts
                if nc.is_closed or time.monotonic() + RETRY_S >= deadline:
                    raise
                await asyncio.sleep(RETRY_S)
    finally:
        await nc.close()
