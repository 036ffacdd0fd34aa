"""`kvmesh up` with services on the real runner: replicas ready, heartbeats in `workers`, clean drain on down."""

from __future__ import annotations

import asyncio

import nats
from kvmesh.protocol.subjects import WORKERS_BUCKET
from kvmesh.stack.state import StackState
from stack_harness import StackDir, admin_nats, pids_for

RUNNER_PACKAGE = "kvmesh_stacktest_runner"


async def heartbeat_keys(state: StackState) -> set[str]:
    nc = await nats.connect(**admin_nats(state))
    kv = await nc.jetstream().key_value(WORKERS_BUCKET)
    try:
        keys = set(await kv.keys())
    except nats.js.errors.NoKeysError:
        keys = set()
    await nc.close()
    return keys


def test_runner_services_get_ready_beat_and_drain(stack: StackDir, model_stub) -> None:
    stack.env["KVMESH_STACK__SERVICES_PACKAGE"] = RUNNER_PACKAGE
    out = stack.up("--replicas", "pinger=2", "--model", str(model_stub))
    assert out.returncode == 0, out.stderr
    state = stack.state()
    assert [r.name for r in state.processes] == ["nats", "s3", "pinger-0", "pinger-1"]
    code, st = stack.status_json()
    assert code == 0 and st["ready"], st
    assert {"pinger-0", "pinger-1"} <= asyncio.run(heartbeat_keys(state))

    assert stack.cli("down").returncode == 0
    assert pids_for(stack.state_dir) == []
    for worker in ("pinger-0", "pinger-1"):  # SIGTERM drained them; they did not get SIGKILLed
        assert '"drained"' in (stack.state_dir / "logs" / f"{worker}.log").read_text()
