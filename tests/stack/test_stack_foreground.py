"""Foreground `kvmesh up`: Ctrl-C, a closed terminal or `kvmesh down` from elsewhere stops everything cleanly."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from kvmesh.net import port_in_use
from kvmesh.stack.procs import is_ours
from kvmesh.stack.state import StackState
from stack_harness import KVMESH, StackDir, pids_for


def start_foreground(stack: StackDir, *extra: str) -> tuple[subprocess.Popen, StackState]:
    proc = subprocess.Popen([KVMESH, *stack.up_args(*extra)], env=stack.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stack.launchers.append(proc)
    end = time.monotonic() + 60
    while time.monotonic() < end and proc.poll() is None:
        stack.remember()
        state = stack.state()
        if state is not None and state.ready_at is not None:
            return proc, state
        time.sleep(0.1)
    raise AssertionError(f"foreground up never got ready: rc={proc.poll()} {proc.stderr.read() if proc.poll() else ''}")


def assert_stopped(stack: StackDir, state: StackState) -> None:
    assert stack.state() is None
    assert not any(is_ours(r) for r in state.processes)
    assert not any(port_in_use(p) for r in state.processes for p in r.ports)
    assert pids_for(stack.state_dir) == []


# SIGTERM reaches the launcher in test_down_from_another_shell_ends_the_foreground_up (down sends it)
@pytest.mark.parametrize("how, replicas", [(signal.SIGINT, 2), (signal.SIGHUP, 0)])
def test_foreground_signal_stops_everything(
    stack: StackDir, model_stub: Path, how: signal.Signals, replicas: int
) -> None:
    proc, state = start_foreground(stack, "--replicas", f"echo={replicas}", "--model", str(model_stub))
    assert {r.name for r in state.processes} == {"nats", "s3", *(f"echo-{i}" for i in range(replicas))}
    code, st = stack.status_json()
    assert code == 0 and st["ready"], st
    proc.send_signal(how)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stack stopped" in out and "Traceback" not in err
    assert_stopped(stack, state)


def test_down_from_another_shell_ends_the_foreground_up(stack: StackDir) -> None:
    proc, state = start_foreground(stack, "--replicas", "echo=0")
    down = stack.cli("down")
    assert down.returncode == 0, down.stderr
    proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert_stopped(stack, state)
