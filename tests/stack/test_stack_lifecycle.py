"""`kvmesh up --detach` -> status -> down, restart keeps data, --fresh wipes it (real processes, real ports)."""

from __future__ import annotations

import asyncio
import io
import json
import stat
import subprocess
import urllib.request
from pathlib import Path

import nats
from kvmesh.credentials.s3 import read_credentials
from kvmesh.protocol.streams import ALL_STREAMS
from kvmesh.stack.state import ProcessRecord, StackState, claim_state
from minio import Minio
from stack_harness import StackDir, admin_nats, assert_all_gone, pids_for

TEST_STREAM = "STACKTEST"


def s3_client(stack: StackDir, state: StackState) -> Minio:
    creds = read_credentials(stack.state_dir)
    assert creds is not None
    return Minio(state.s3_endpoint, access_key=creds.access_key, secret_key=creds.secret_key, secure=False)


async def js_write_and_check_declared(state: StackState) -> None:
    nc = await nats.connect(**admin_nats(state))
    js = nc.jetstream()
    for spec in ALL_STREAMS:  # declare_all ran
        await js.stream_info(spec.name)
    await js.add_stream(name=TEST_STREAM, subjects=["stacktest.>"])
    await js.publish("stacktest.one", b"kept across restarts")
    await nc.close()


async def js_messages(state: StackState) -> int:
    nc = await nats.connect(**admin_nats(state))
    js = nc.jetstream()
    try:
        info = await js.stream_info(TEST_STREAM)
    except nats.js.errors.NotFoundError:
        await nc.close()
        return 0
    if info.state.messages:
        assert (await js.get_msg(TEST_STREAM, 1)).data == b"kept across restarts"
    await nc.close()
    return info.state.messages


def test_up_status_down_restart_fresh(stack: StackDir, model_stub: Path) -> None:
    out = stack.up("--replicas", "echo=1", "--model", str(model_stub))
    assert out.returncode == 0, out.stderr
    assert "ready" in out.stdout and "nats://" in out.stdout
    state = stack.state()
    assert state is not None and {r.name for r in state.processes} == {"nats", "s3", "echo-0"}

    code, st = stack.status_json()
    assert code == 0 and st["ready"] and st["running"]
    assert all(p["alive"] and p["rss_bytes"] > 0 for p in st["processes"])
    assert all(e["reachable"] and e["ready"] for e in st["endpoints"])
    assert st["rss_total_bytes"] == sum(p["rss_bytes"] for p in st["processes"])

    # the service was told where everything is, through the settings it reads
    echo = next(e for e in state.endpoints if e.name == "echo-0")
    told = json.loads(urllib.request.urlopen(echo.url + "/settings", timeout=5).read())
    assert told["nats_url"] == state.nats_url and told["s3_endpoint"] == state.s3_endpoint
    assert told["worker_id"] == "echo-0" and told["http_port"] == int(echo.url.rsplit(":", 1)[1])
    assert told["state_dir"] == str(stack.state_dir.resolve())
    assert told["model_dir"] == str(model_stub.resolve())
    creds_file = stack.state_dir / "s3-credentials.json"
    assert stat.S_IMODE(creds_file.stat().st_mode) == 0o600
    assert told["s3_access_key"] == read_credentials(stack.state_dir).access_key

    asyncio.run(js_write_and_check_declared(state))
    s3_client(stack, state).put_object(state.s3_bucket, "probe/kept", io.BytesIO(b"object"), 6)

    again = stack.up()
    assert again.returncode == 3 and "already running" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and "Traceback" not in again.stderr

    down = stack.cli("down")
    assert down.returncode == 0, down.stderr
    assert_all_gone(stack, state)
    creds_before = creds_file.read_text()

    # restart: same data, same credentials
    assert stack.up("--replicas", "echo=0").returncode == 0
    state2 = stack.state()
    assert creds_file.read_text() == creds_before
    assert asyncio.run(js_messages(state2)) == 1
    assert s3_client(stack, state2).get_object(state2.s3_bucket, "probe/kept").read() == b"object"
    assert stack.cli("down").returncode == 0
    assert_all_gone(stack, state2)

    # --fresh wipes JetStream and S3 data (the bucket is made again, empty)
    assert stack.up("--replicas", "echo=0", "--fresh").returncode == 0
    state3 = stack.state()
    assert asyncio.run(js_messages(state3)) == 0
    assert list(s3_client(stack, state3).list_objects(state3.s3_bucket, recursive=True)) == []
    assert stack.cli("down").returncode == 0
    assert_all_gone(stack, state3)


def test_down_and_status_when_nothing_runs(stack: StackDir) -> None:
    down = stack.cli("down")
    assert down.returncode == 0 and "no kvmesh stack is running" in down.stdout
    code, st = stack.status_json()
    assert code == 1 and st == {**st, "running": False, "ready": False, "processes": [], "endpoints": []}


def test_stale_record_is_cleared_by_down_and_ignored_by_up(stack: StackDir) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = StackState(state_dir=str(stack.state_dir.resolve()), launcher_pid=gone.pid, launcher_ticks=1,
                       detached=True, processes=[ProcessRecord(name="nats", kind="server", pid=gone.pid,
                                                               start_ticks=1, started_at=0, log="x")])
    stack.state_dir.mkdir()
    assert claim_state(stale)
    code, st = stack.status_json()
    assert code == 1 and not st["running"] and st["processes"][0]["alive"] is False
    down = stack.cli("down")
    assert down.returncode == 0 and "stale" in down.stdout and stack.state() is None
    assert claim_state(stale)  # a stale record does not block `up` either
    out = stack.up("--replicas", "echo=0", "--timeout", "30")
    assert out.returncode == 0, out.stderr
    assert stack.state().launcher_pid != gone.pid
    assert stack.cli("down").returncode == 0 and pids_for(stack.state_dir) == []
