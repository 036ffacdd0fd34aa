"""The first connect: retried while NATS starts, a clear error when it never answers."""

from __future__ import annotations

import asyncio
import threading

import pytest
from kvmesh.bus.connection import connect
from kvmesh.net import free_port

from tests.waits import until

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


async def test_a_server_error_reconnects_instead_of_closing(nats_server):
    """A server -ERR on an open connection (here 'Unknown Protocol Operation', after which the server drops
    the link) must leave a working connection behind, not a closed one that no call can use again."""
    nc = await connect(nats_server.url, "err-then-work", FAST_BUS)
    try:
        reconnects = nc.stats["reconnects"]
        nc._transport.write(b"NOT-A-PROTOCOL-OP\r\n")  # the server answers -ERR and hangs up
        await nc._transport.drain()
        await until(lambda: nc.stats["reconnects"] > reconnects and nc.is_connected, timeout_s=20,
                    what="a reconnect after the server error")
        assert not nc.is_closed
        sub = await nc.subscribe("after.error")
        await nc.publish("after.error", b"still here")
        msg = await sub.next_msg(timeout=5)
        assert msg.data == b"still here"
    finally:
        await nc.close()


async def test_a_refusal_stays_the_reason_when_later_tries_are_reset() -> None:
    """A server that refuses the credentials once and then resets every connection (as a loaded nats-server may
    do to a client it refused): the error names the refusal, not the last reset."""
    tries = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal tries
        tries += 1
        if tries == 1:
            writer.write(b'INFO {"server_id":"fake","version":"2.10.0","max_payload":1048576,"auth_required":true}\r\n')
            await reader.readline()  # CONNECT
            writer.write(b"-ERR 'Authorization Violation'\r\n")
            await writer.drain()
        writer.transport.abort()  # later tries: reset at once

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(ConnectionError) as gave_up:
            await connect(f"nats://127.0.0.1:{port}", "refused",
                          FAST_BUS.model_copy(update={"connect_retry_total_s": 1.5}))
    finally:
        server.close()
    assert tries > 1 and "authorization violation" in str(gave_up.value).lower()
