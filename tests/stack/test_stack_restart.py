"""Day two: a stack restarted on its own state dir comes up with its cache, NATS users on (the default).

Each test serves a prompt through the real services with the tiny checkpoint,
stops the stack one of the ways a stack stops (a clean `kvmesh down`; SIGKILL
of every process, nats-server and weed included), starts it again on the same
state dir and asks the same prompt: the answer is the same tokens and its
prefix is a cache hit (from L3: the workers' memory went with them). The NATS
log must hold no permission violation after either start.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import urllib.request
from pathlib import Path

import nats
import pytest
from kvmesh.credentials.s3 import read_credentials
from kvmesh.net import free_port
from kvmesh.protocol import subjects
from kvmesh.stack.procs import is_ours
from kvmesh.stack.servers import pid_alive
from kvmesh.stack.state import StackState
from minio import Minio
from openai import OpenAI
from stack_harness import StackDir, admin_nats, pids_for
from waits import until_sync

KEY = "sk-kvmesh-restart-test"
SYSTEM = ("You are a careful assistant. Answer every question about the weather, trains, tea, rivers and "
          "mountains in full detail, and say which sources you used.")
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is it raining in the hills?"}]


def _up(stack: StackDir, model: Path, ports: list[str]) -> StackState:
    out = stack.cli("up", "--detach", *ports, "--model", str(model), "--timeout", "240", timeout=300)
    assert out.returncode == 0, out.stderr
    state = stack.state()
    assert state is not None
    return state


def _ask(port: int, model: Path):
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
    return client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=8, temperature=0)


def _l3_objects(stack: StackDir, state: StackState) -> int:
    creds = read_credentials(stack.state_dir)
    assert creds is not None
    client = Minio(state.s3_endpoint, access_key=creds.access_key, secret_key=creds.secret_key, secure=False)
    return sum(1 for _ in client.list_objects(state.s3_bucket, recursive=True))


def _wait_for(what: str, check, timeout: float = 120.0) -> None:
    """Poll `check` until it holds (each poll asks the real server); fail naming `what` after `timeout`."""
    until_sync(check, timeout, what, poll_s=0.25)


async def _snapshot_size(state: StackState) -> int:
    nc = await nats.connect(**admin_nats(state))
    try:
        store = await nc.jetstream().object_store(subjects.INDEX_SNAPSHOT_BUCKET)
        return (await store.get_info("index")).size
    except nats.js.errors.Error:
        return 0
    finally:
        await nc.close()


def _violations(stack: StackDir) -> list[str]:
    log = (stack.state_dir / "nats" / "nats.log").read_text()
    return [line for line in log.splitlines() if "Violation" in line][:5]


def _serve_and_fill(stack: StackDir, model: Path, port: int) -> str:
    """Serve the prompt twice (a hit), then wait until its blocks are in L3 and the index has a snapshot."""
    first = _ask(port, model)
    assert first.choices[0].message.content and first.usage.completion_tokens == 8
    assert _ask(port, model).usage.prompt_tokens_details.cached_tokens > 0
    state = stack.state()
    _wait_for("the prompt's blocks in L3", lambda: _l3_objects(stack, state) > 0)
    _wait_for("an index snapshot", lambda: asyncio.run(_snapshot_size(state)) > 0)
    return first.choices[0].message.content


def _assert_served_from_cache(stack: StackDir, model: Path, port: int, answer: str) -> None:
    again = _ask(port, model)
    assert again.choices[0].message.content == answer
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    code, st = stack.status_json()
    assert code == 0 and st["ready"], st
    assert _violations(stack) == []


@pytest.fixture
def restart_stack(stack: StackDir) -> tuple[StackDir, int, list[str]]:
    """The real services on fixed ports (a restart keeps them), snapshots every 2 s."""
    port = free_port()
    stack.env.update(KVMESH_STACK__SERVICES_PACKAGE="kvmesh.services", KVMESH_INGRESS__PORT=str(port),
                     KVMESH_API_KEYS=f"{KEY}:tenant-a", KVMESH_INDEX__SNAPSHOT_EVERY_S="2")
    ports = ["--nats-port", str(free_port()), "--nats-monitor-port", str(free_port()), "--s3-port", str(free_port())]
    return stack, port, ports


@pytest.mark.slow
def test_down_then_up_keeps_the_cache(restart_stack, tiny_model_dir: Path) -> None:
    stack, port, ports = restart_stack
    _up(stack, tiny_model_dir, ports)
    answer = _serve_and_fill(stack, tiny_model_dir, port)
    assert stack.cli("down").returncode == 0

    _up(stack, tiny_model_dir, ports)
    try:
        _assert_served_from_cache(stack, tiny_model_dir, port, answer)
    finally:
        assert stack.cli("down").returncode == 0


def _restart_service(stack: StackDir, name: str) -> None:
    """SIGKILL one service and start it again as the stack did: same command line, environment and user."""
    state = stack.state()
    rec = next(r for r in state.processes if r.name == name)
    argv = [a.decode() for a in Path(f"/proc/{rec.pid}/cmdline").read_bytes().split(b"\0") if a]
    raw = Path(f"/proc/{rec.pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
    cwd = os.readlink(f"/proc/{rec.pid}/cwd")
    os.kill(rec.pid, signal.SIGKILL)
    _wait_for(f"{name} gone", lambda: not pid_alive(rec.pid), timeout=30)
    endpoint = next(e for e in state.endpoints if e.name == name)
    with open(stack.state_dir / "logs" / f"{name}.restarted.log", "ab") as log:
        stack.launchers.append(subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT))
    _wait_for(f"{name} ready again", lambda: _ready(endpoint.url))


def _ready(url: str) -> bool:
    try:
        return urllib.request.urlopen(url + "/readyz", timeout=2).status == 200
    except OSError:
        return False


@pytest.mark.slow
def test_one_service_at_a_time_restarts_into_the_running_stack(restart_stack, tiny_model_dir: Path) -> None:
    stack, port, ports = restart_stack
    _up(stack, tiny_model_dir, ports)
    try:
        answer = _serve_and_fill(stack, tiny_model_dir, port)
        for name in ("cache_index-0", "eviction-0", "prefill-0", "decode-0"):
            _restart_service(stack, name)
            assert _ask(port, tiny_model_dir).choices[0].message.content == answer, name
        assert _violations(stack) == []
    finally:
        stack.cli("down")


@pytest.mark.slow
def test_kill_9_of_every_process_then_up_keeps_the_cache(restart_stack, tiny_model_dir: Path) -> None:
    stack, port, ports = restart_stack
    state = _up(stack, tiny_model_dir, ports)
    answer = _serve_and_fill(stack, tiny_model_dir, port)
    pids = {r.pid for r in state.processes if is_ours(r)} | set(pids_for(stack.state_dir))
    assert {"nats", "s3"} <= {r.name for r in state.processes}
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    _wait_for("every process gone", lambda: not any(pid_alive(p) for p in pids), timeout=30)

    _up(stack, tiny_model_dir, ports)  # the stale record is cleared; servers reopen their data
    try:
        _assert_served_from_cache(stack, tiny_model_dir, port, answer)
    finally:
        assert stack.cli("down").returncode == 0
