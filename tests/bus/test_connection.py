"""The first connect: retried while NATS starts, a clear error when it never answers."""

from __future__ import annotations

import asyncio
import threading

import pytest

from shared.bus.connection import connect
from shared.stack.servers import free_port

from .helpers import FAST_BUS


async def test_first_connect_waits_for_a_late_server(fresh_nats_server):
    server = fresh_nats_server
    server.stop()
    connecting = asyncio.create_task(connect(server.url, "early-bird", FAST_BUS))
    done, _ = await asyncio.wait({connecting}, timeout=0.3)
    assert not done  # still trying: the server is down
    starter = threading.Thread(target=server.start)
    starter.start()
    nc = await asyncio.wait_for(connecting, 20)
    starter.join()
    try:
        assert nc.is_connected
        await nc.flush()
    finally:
        await nc.close()


async def test_first_connect_gives_up_with_a_clear_error():
    url = f"nats://127.0.0.1:{free_port()}"
    settings = FAST_BUS.model_copy(update={"connect_retry_total_s": 0.5})
    with pytest.raises(ConnectionError, match=rf"NATS at {url} did not answer within"):
        await connect(url, "nobody-home", settings)
