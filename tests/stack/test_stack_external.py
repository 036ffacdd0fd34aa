"""KVMESH_NATS_URL / KVMESH_S3_ENDPOINT: `up` uses those servers, starts none, and `down` leaves them running.

The service here ignores SIGTERM, so `down` must escalate to SIGKILL after its grace period.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
from kvmesh.protocol.streams import ALL_STREAMS
from kvmesh.stack.procs import is_ours
from kvmesh.stack.servers import NatsServer, S3Server, pid_alive
from stack_harness import StackDir, pids_for


async def stream_names(url: str) -> set[str]:
    nc = await nats.connect(url)
    names = {s.config.name for s in await nc.jetstream().streams_info()}
    await nc.close()
    return names


def test_external_servers_are_used_not_started(
    stack: StackDir, nats_server: NatsServer, s3_server: S3Server, model_stub: Path
) -> None:
    stack.env.update(
        KVMESH_NATS_URL=nats_server.url, KVMESH_S3_ENDPOINT=s3_server.endpoint,
        KVMESH_S3_ACCESS_KEY=s3_server.access_key, KVMESH_S3_SECRET_KEY=s3_server.secret_key,
        KVMESH_S3__BUCKET="kvmesh-stack-external", STACKTEST_IGNORE_SIGTERM="1",
    )
    out = stack.up("--replicas", "echo=1", "--model", str(model_stub))
    assert out.returncode == 0, out.stderr
    state = stack.state()
    assert [r.name for r in state.processes] == ["echo-0"]
    assert state.nats_url == nats_server.url and state.s3_endpoint == s3_server.endpoint
    assert s3_server.client().bucket_exists("kvmesh-stack-external")
    assert {s.name for s in ALL_STREAMS} <= asyncio.run(stream_names(nats_server.url))

    code, st = stack.status_json()
    assert code == 0 and st["ready"] and {e["name"] for e in st["endpoints"]} == {"nats", "s3", "echo-0"}

    echo = state.processes[0]
    started = time.monotonic()
    down = stack.cli("down", "--grace", "1")
    assert down.returncode == 0 and "stopped 1 processes" in down.stdout and "echo-0" in down.stdout
    assert time.monotonic() - started >= 1.0 and not is_ours(echo)  # waited out the grace, then SIGKILL
    assert pids_for(stack.state_dir) == []
    assert pid_alive(nats_server.process.pid) and pid_alive(s3_server.process.pid)
