"""Start the two servers of a local stack and describe them as state records.

Ports of 0 mean "pick a free one". SeaweedFS needs nine internal ports
besides S3; they are kept in ``<state_dir>/s3/ports.json`` and reused on
restart (its master keeps metadata in a directory named after its port).
A NATS cluster keeps each node's ports in ``<state_dir>/nats-<i>/ports.json``
the same way; node 0 takes the configured client and monitor ports.
A local NATS runs with users by default (`nats.auth`): one per service
replica and `admin`, passwords in ``<state_dir>/nats-credentials.json``;
with `nats.tls_cert`/`tls_key` it takes TLS connections only.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

from kvmesh.bus.client_auth import ClientAuth
from kvmesh.bus.permissions import VLLM
from kvmesh.config import Settings
from kvmesh.credentials.nats import (
    NatsCredentials,
    load_or_create_nats_credentials,
    service_role,
)
from kvmesh.credentials.nats_access import NatsTls
from kvmesh.credentials.s3 import S3Credentials
from kvmesh.net import claimed, port_in_use, reserve
from kvmesh.stack.errors import ExitCode, StackError
from kvmesh.stack.procs import start_ticks
from kvmesh.stack.servers import (
    BinaryMissingError,
    ManagedProcess,
    NatsNodePorts,
    NatsServer,
    PortInUseError,
    S3Server,
    ServerError,
    nats_cluster,
)
from kvmesh.stack.services import ServiceSpec
from kvmesh.stack.state import Endpoint, ProcessRecord

CLUSTER_NAME = "kvmesh-nats"  # nodes are kvmesh-nats-<i>; stable names keep their JetStream data across restarts


def process_record(mp: ManagedProcess, kind: str, ports: list[int], name: str | None = None) -> ProcessRecord:
    return ProcessRecord(
        name=name or mp.name, kind=kind, pid=mp.pid, start_ticks=start_ticks(mp.pid),
        started_at=time.time(), log=str(mp.log_path), ports=ports,
    )


def _start(server: NatsServer | S3Server, what: str, timeout_s: float) -> ManagedProcess:
    """server.start() with its failures turned into StackErrors; a half-started server is stopped."""
    try:
        return server.start(detach=True, ready_timeout_s=timeout_s)
    except PortInUseError as exc:
        raise StackError(ExitCode.PORT_IN_USE, str(exc)) from None
    except BinaryMissingError as exc:
        raise StackError(ExitCode.BINARY_MISSING, str(exc)) from None
    except ServerError as exc:
        server.stop()
        log = server.process.log_path if server.process else server.data_dir
        raise StackError(ExitCode.START_FAILED, f"{what}: {exc} (log: {log})") from None


def stack_nats_users(settings: Settings, state_dir: Path, specs: Sequence[ServiceSpec]) -> NatsCredentials | None:
    """The local NATS's users (one per service replica, plus admin), or None: external NATS, or auth off."""
    if settings.nats_url is not None or not settings.nats.auth:
        return None
    wanted = {f"{s.name}-{i}": service_role(s.name) for s in specs for i in range(s.replicas)}
    wanted[VLLM] = VLLM  # vLLM instances with kvmesh's connector join as this per-role user (docs/vllm-connector.md)
    return load_or_create_nats_credentials(state_dir, wanted)


def stack_nats_tls(settings: Settings) -> NatsTls | None:
    """The local NATS's certificate (nats.tls_cert and tls_key), or None: plain TCP."""
    n = settings.nats
    if settings.nats_url is not None or n.tls_cert is None:
        return None
    if n.tls_key is None:
        raise StackError(ExitCode.USAGE, "nats.tls_cert needs nats.tls_key (KVMESH_NATS__TLS_KEY)")
    return NatsTls(cert=n.tls_cert, key=n.tls_key, ca=n.tls_ca)


def stack_admin_auth(settings: Settings, users: NatsCredentials | None) -> ClientAuth | None:
    """How the launcher itself connects (declaring streams): admin, TLS-verifying with nats.tls_ca."""
    if users is None and stack_nats_tls(settings) is None:
        return None
    auth = users.admin() if users is not None else ClientAuth()
    return dataclasses.replace(auth, tls_ca=settings.nats.tls_ca) if settings.nats.tls_ca else auth


def local_nats(
    state_dir: Path, nodes: int, host: str, port: int, monitor_port: int, max_payload: int, bin_dir: Path | None,
    users: NatsCredentials | None = None, tls: NatsTls | None = None,
) -> list[NatsServer]:
    """One node storing under <state_dir>/nats, or a cluster of `nodes` (see nats_cluster), not started yet."""
    auth = users.server_auth() if users is not None else None
    if nodes == 1:
        return [NatsServer(data_dir=state_dir / "nats", host=host, port=port, monitor_port=monitor_port,
                           max_payload=max_payload, bin_dir=bin_dir, auth=auth, tls=tls)]
    configured = {p for p in (port, monitor_port) if p}
    ports = [_reusable_node_ports(state_dir / f"nats-{i}" / "ports.json", host, configured) for i in range(nodes)]
    ports[0] = NatsNodePorts(port or ports[0].client, monitor_port or ports[0].monitor, ports[0].cluster)
    return nats_cluster(state_dir, nodes, CLUSTER_NAME, ports, host=host, max_payload=max_payload, bin_dir=bin_dir,
                        auth=auth, tls=tls)


def start_nats(server: NatsServer, timeout_s: float) -> tuple[ProcessRecord, list[Endpoint]]:
    """Start one node, named after its store dir ("nats", or "nats-<i>" in a cluster)."""
    name = server.data_dir.name
    mp = _start(server, f"nats-server {name}" if server.cluster else "nats-server", timeout_s)
    ports = [server.port, server.monitor_port]
    # a cluster node is healthy once it sees a meta leader and its streams are current, a lone one once JetStream is on
    health = "/healthz"
    if server.cluster:
        ports.append(server.cluster["port"])
        (server.data_dir / "ports.json").write_text(json.dumps(
            {"client": server.port, "monitor": server.monitor_port, "cluster": server.cluster["port"]}))
    else:
        health += "?js-enabled-only=true"
    endpoints = [
        Endpoint(name=name, url=server.url, check="nats"),
        Endpoint(name=f"{name}-monitor", url=f"http://{server.host}:{server.monitor_port}", check="http",
                 ready_path=health),
    ]
    return process_record(mp, "server", ports, name=name), endpoints


S3_NICE = 10


def start_s3(
    state_dir: Path, host: str, port: int, creds: S3Credentials, bucket: str, bin_dir: Path | None, timeout_s: float
) -> tuple[ProcessRecord, Endpoint]:
    data_dir = state_dir / "s3"
    server = S3Server(
        data_dir=data_dir, host=host, port=port, access_key=creds.access_key, secret_key=creds.secret_key,
        bin_dir=bin_dir, extra_ports=_reusable_ports(data_dir / "ports.json", host),
        nice=S3_NICE,  # on one box the object store's work waits for spare CPU, as the uploads do
    )
    mp = _start(server, "S3 server", timeout_s)
    (data_dir / "ports.json").write_text(json.dumps(server.extra_ports))
    try:
        server.ensure_bucket(bucket)
    except Exception as exc:  # noqa: BLE001 - report any S3 failure as one line
        server.stop()
        raise StackError(ExitCode.START_FAILED, f"S3 server: creating bucket '{bucket}' failed: {exc}") from None
    record = process_record(mp, "server", [server.port, *server.extra_ports.values()])
    return record, Endpoint(name="s3", url=f"http://{server.endpoint}", check="s3", bucket=bucket)


def _reusable_ports(path: Path, host: str) -> dict[str, int]:
    """Last run's internal ports when all are still free, else none (fresh ones get picked)."""
    try:
        ports = {str(k): int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}
    if any(port_in_use(p, host) or claimed(p) for p in ports.values()):
        return {}
    reserve(*ports.values())
    return ports


def _reusable_node_ports(path: Path, host: str, configured: set[int]) -> NatsNodePorts:
    """A cluster node's ports of the last run, each kept while still free (0: pick a new one)."""
    try:
        saved = NatsNodePorts(**{k: int(v) for k, v in json.loads(path.read_text()).items()})
    except (OSError, ValueError, TypeError, AttributeError):
        return NatsNodePorts()

    def keep(p: int) -> int:
        if not p or p in configured or claimed(p) or port_in_use(p, host):
            return 0
        reserve(p)
        return p

    return NatsNodePorts(keep(saved.client), keep(saved.monitor), keep(saved.cluster))
