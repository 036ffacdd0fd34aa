"""The stack tests' harness: run the real `kvmesh` CLI against a tmp state dir and clean up by PID.

Every process any `up` recorded is remembered, and whatever is still alive
at the end of a test is SIGKILLed, even when the test failed half way.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.bus.client_auth import connect_kwargs
from kvmesh.credentials.nats import admin_auth
from kvmesh.net import free_port, port_in_use
from kvmesh.stack.errors import ExitCode
from kvmesh.stack.procs import is_ours
from kvmesh.stack.servers import pid_alive
from kvmesh.stack.state import ProcessRecord, StackState, load_state

KVMESH = str(Path(sys.executable).parent / "kvmesh")
SVC_PATH = Path(__file__).parent / "svcpkg"
SVC_PACKAGE = "kvmesh_stacktest_svc"


@dataclass
class StackDir:
    """A state dir for one test, the env the CLI runs with, and every process seen."""

    state_dir: Path
    env: dict[str, str]
    seen: dict[int, ProcessRecord] = field(default_factory=dict)
    launchers: list[subprocess.Popen] = field(default_factory=list)

    def cli(self, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
        out = subprocess.run([KVMESH, *args], env={**self.env, **env}, capture_output=True, text=True,
                             timeout=timeout)
        self.remember()
        return out

    def up_args(self, *extra: str) -> list[str]:
        """Free ports chosen up front, so a test knows them before the stack records them."""
        return ["up", "--nats-port", str(free_port()), "--nats-monitor-port", str(free_port()),
                "--s3-port", str(free_port()), *extra]

    def up(self, *extra: str, **env: str) -> subprocess.CompletedProcess:
        return self.cli(*self.up_args("--detach", *extra), **env)

    def state(self) -> StackState | None:
        return load_state(self.state_dir)

    def remember(self) -> None:
        state = self.state()
        if state is not None:
            self.seen.update({r.pid: r for r in state.processes})

    def status_json(self) -> tuple[int, dict]:
        out = self.cli("status", "--json")
        return out.returncode, json.loads(out.stdout)

    def kill_leftovers(self) -> None:
        """SIGKILL every recorded process still alive and any process started for this state dir."""
        for proc in self.launchers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.remember()
        pids = {r.pid for r in self.seen.values() if is_ours(r)} | set(pids_for(self.state_dir))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def admin_nats(state: StackState) -> dict:
    """`nats.connect` keyword arguments for the stack's NATS as its admin user (its NATS has users by default)."""
    return connect_kwargs(state.nats_url, admin_auth(Path(state.state_dir)))


def pids_for(state_dir: Path) -> list[int]:
    """Live processes whose command line or environment names state_dir (servers, services, launchers)."""
    needle = str(state_dir).encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "cmdline").read_bytes() or needle in (proc / "environ").read_bytes():
                if pid_alive(int(proc.name)):
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


def assert_all_gone(stack: StackDir, state: StackState) -> None:
    """No recorded process alive, no recorded port listening, no state/pid/socket file left."""
    for rec in state.processes:
        assert not is_ours(rec), f"{rec.name} (pid {rec.pid}) still alive"
        for port in rec.ports:
            assert not port_in_use(port), f"port {port} of {rec.name} still bound"
    assert stack.state() is None and not (stack.state_dir / "stack.json").exists()
    for path in stack.state_dir.rglob("*"):
        assert not stat.S_ISSOCK(path.lstat().st_mode), f"socket left: {path}"
        assert path.suffix != ".pid", f"pid file left: {path}"
    assert pids_for(stack.state_dir) == []


def assert_one_line_failure(out, code: ExitCode, *needles: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code, (out.returncode, out.stderr)
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def without_vllm(tmp_path: Path) -> dict[str, str]:
    """The environment of a `kvmesh` whose Python cannot import vLLM, in a venv that has it: a sitecustomize
    (first on PYTHONPATH) marks the module absent, as an install without vLLM finds it."""
    hide = tmp_path / "hide-vllm"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    return {"PYTHONPATH": str(hide)}
