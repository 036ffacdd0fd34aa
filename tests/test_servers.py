"""The fixtures' servers are real, loopback-bound, and leave nothing behind."""

from __future__ import annotations

import io

import nats
import pytest
from kvmesh.net import port_in_use
from kvmesh.stack.servers import NatsServer, S3Server


async def test_nats_jetstream_sync_always(nats_server: NatsServer) -> None:
    assert "sync_interval: always" in (nats_server.data_dir / "nats.conf").read_text()
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    info = await js.account_info()
    assert info.limits is not None
    await nc.close()


def test_s3_put_get(s3_server: S3Server) -> None:
    s3_server.ensure_bucket("kvmesh-test")
    client = s3_server.client()
    client.put_object("kvmesh-test", "probe/key", io.BytesIO(b"abc"), 3)
    assert client.get_object("kvmesh-test", "probe/key").read() == b"abc"


@pytest.mark.parametrize("cls", [NatsServer, S3Server])
def test_stop_frees_port(cls, tmp_path) -> None:
    server = cls(data_dir=tmp_path)
    server.start()
    port = server.port
    assert port_in_use(port)
    server.stop()
    assert not port_in_use(port)
