"""`kvmesh up`: start NATS, the S3 server and every service, wait until all are ready.

Order: claim the state dir (state file created exclusively) -> preflight ->
servers (NATS: one node, or a routed cluster of --nats-cluster nodes) ->
streams -> services -> readiness. The state file is updated
after each start, so a failure or Ctrl-C at any point stops exactly what
was started (services first) and leaves no state file behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.config import Settings
from kvmesh.credentials.nats import NatsCredentials
from kvmesh.credentials.s3 import S3Credentials, load_or_create_credentials
from kvmesh.net import reserve
from kvmesh.stack.declare import declare_streams
from kvmesh.stack.errors import ExitCode, StackError
from kvmesh.stack.launch import (
    local_nats,
    process_record,
    stack_admin_auth,
    stack_nats_tls,
    stack_nats_users,
    start_nats,
    start_s3,
)
from kvmesh.stack.model import resolve_model_dir
from kvmesh.stack.preflight import (
    check_external_nats,
    check_external_s3,
    choose_engine,
    ensure_binaries,
    ensure_ports_free,
    ensure_writable,
)
from kvmesh.stack.probe import check_endpoint, host_port
from kvmesh.stack.procs import is_ours, launcher_alive, start_ticks, stop_in_order
from kvmesh.stack.servers import valid_nats_cluster_size
from kvmesh.stack.services import (
    ServiceContext,
    build_specs,
    discover_services,
    start_service,
)
from kvmesh.stack.state import (
    Endpoint,
    StackState,
    claim_state,
    load_state,
    remove_state,
    save_state,
)

# Ctrl-C, `kill`, and the terminal closing all stop the stack cleanly instead of orphaning it.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PROGRESS_S = 15.0  # how often a start that is not ready yet says what it waits for


@dataclass(frozen=True, slots=True)
class UpOptions:
    """What the CLI asked for; ports of 0 pick free ones."""

    state_dir: Path
    detach: bool = False
    fresh: bool = False
    model_dir: Path | None = None
    preset: str | None = None  # a random-weight preset instead of the default model (shared/stack/model.py)
    replicas: dict[str, int] = field(default_factory=dict)  # service name -> count, default 1
    nats_nodes: int = 1  # local NATS: one node, or a cluster of an odd number >= 3 (streams then R3)
    nats_port: int = 4222
    nats_monitor_port: int = 8222
    s3_port: int = 8333


def up(settings: Settings, opts: UpOptions, say: Callable[[str], None]) -> StackState:
    """Start the stack; return once all is ready (--detach), or hold it until a STOP_SIGNAL or `kvmesh down`.

    Any failure or interrupt before that stops what was started; the foreground stack is stopped on return.
    """
    state_dir = opts.state_dir.resolve()
    ensure_writable(state_dir)
    state = _claim(state_dir, opts.detach)
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in STOP_SIGNALS}
    try:
        try:
            _start_everything(settings, opts, state, say)
        except BaseException:
            _teardown(state, settings.stack.stop_grace_s)
            raise
        if not opts.detach:
            try:
                say("running in the foreground; Ctrl-C stops the stack")
                _hold(state, say)
            finally:
                _teardown(state, settings.stack.stop_grace_s)
            say("stack stopped")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return state


def _hold(state: StackState, say: Callable[[str], None]) -> None:
    """Wait for a STOP_SIGNAL, `kvmesh down` removing the state file, or every process gone; report each death."""
    all_names = {r.name for r in state.processes}
    reported: set[str] = set()
    try:
        while load_state(Path(state.state_dir)) is not None and (not state.processes or reported != all_names):
            for rec in state.processes:
                if rec.name not in reported and not is_ours(rec):
                    reported.add(rec.name)
                    say(f"{rec.name} (pid {rec.pid}) exited; see {rec.log}")
            time.sleep(0.3)
    except KeyboardInterrupt:
        say("stopping the stack ...")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _claim(state_dir: Path, detach: bool) -> StackState:
    existing = load_state(state_dir)
    if existing is not None and _running(existing):
        raise StackError(
            ExitCode.ALREADY_RUNNING,
            f"a kvmesh stack is already running from {state_dir} (see `kvmesh status`, stop it with `kvmesh down`)",
        )
    remove_state(state_dir)  # stale: nothing of it is alive
    me = os.getpid()
    state = StackState(state_dir=str(state_dir), launcher_pid=me, launcher_ticks=start_ticks(me), detached=detach)
    if not claim_state(state):
        raise StackError(ExitCode.ALREADY_RUNNING, f"another `kvmesh up` is starting from {state_dir}")
    return state


def _running(state: StackState) -> bool:
    return launcher_alive(state) or any(is_ours(r) for r in state.processes)


def _start_everything(settings: Settings, opts: UpOptions, state: StackState, say: Callable[[str], None]) -> None:
    state_dir = Path(state.state_dir)
    t0 = time.monotonic()
    package = settings.stack.services_package
    engine = choose_engine(settings.engine.backend, opts.replicas)
    if engine.note:
        say(engine.note)
    services = discover_services(package)
    specs = build_specs(package, services, engine.counts(services))
    _preflight(settings, opts)
    if opts.fresh:
        for data in (state_dir / "nats", state_dir / "s3", *state_dir.glob("nats-[0-9]*")):
            shutil.rmtree(data, ignore_errors=True)
    nats_users = stack_nats_users(settings, state_dir, specs)  # None: external NATS, or nats.auth off
    _nats(settings, opts, state, nats_users)
    creds = _s3(settings, opts, state)
    declare_streams(state.nats_url, _stream_replicas(settings, opts), settings.stack.ready_timeout_s,
                    stack_admin_auth(settings, nats_users))
    needs_model = any(s.replicas for s in specs)
    model_dir = resolve_model_dir(opts.model_dir or settings.model_dir, state_dir, needed=needs_model, preset=opts.preset)
    ctx = ServiceContext(nats_url=state.nats_url, s3_endpoint=state.s3_endpoint, s3_bucket=state.s3_bucket,
                         creds=creds, state_dir=state_dir, model_dir=model_dir, host=settings.service.http_host,
                         nats_users=nats_users, nats_tls_ca=settings.nats.tls_ca if stack_nats_tls(settings) else None,
                         engine_backend=engine.backend)
    if settings.api_keys is None and any(s.name == "ingress" and s.replicas for s in specs):
        from kvmesh.ingress.admission.auth import (  # the stack needs fastapi only here
            KEYS_FILE,
            ensure_dev_key,
        )

        keys_file = settings.ingress.keys_file or state_dir / KEYS_FILE
        key = ensure_dev_key(keys_file)
        say(f"created a dev API key (tenant 'dev'): {key}" if key else f"API keys: {keys_file}")
        say(f"API: http://{settings.ingress.host}:{settings.ingress.port}/v1 (OpenAI and Anthropic dialects)")
    if any(s.name == "ingress" and s.replicas for s in specs) and not (
            settings.ingress_secret or settings.ingress.secret_file):
        from kvmesh.ingress.admission.salt_secret import (
            ensure_dev_secret,  # dev mode: the salt secret lives in the state dir
        )

        if ensure_dev_secret(state_dir):
            say(f"created the ingress salt secret {state_dir}/ingress_secret (keep it: a new one is a cold cache)")
    for spec in specs:
        for i in range(spec.replicas):
            started = start_service(spec, i, ctx, state_dir / "logs")
            state.processes.append(process_record(started.process, "service", [started.http_port]))
            state.endpoints.append(Endpoint(name=started.worker_id, url=f"http://{started.host}:{started.http_port}",
                                            check="http", ready_path="/readyz"))
            save_state(state)
    _wait_ready(state, creds, t0 + settings.stack.ready_timeout_s, say)
    state.ready_at = time.time()
    save_state(state)
    say(f"kvmesh stack ready in {time.monotonic() - t0:.1f}s (state dir {state_dir})")
    for e in state.endpoints:
        say(f"  {e.name:<14} {e.url}" + (f"  bucket {e.bucket}" if e.bucket else ""))


def _nats(settings: Settings, opts: UpOptions, state: StackState, users: NatsCredentials | None) -> None:
    """Start the local nats-server node(s), or take the external one; record it either way.

    Each node is recorded as soon as it runs, so a failure on the next one still stops it.
    """
    if settings.nats_url is None:
        nodes = local_nats(Path(state.state_dir), opts.nats_nodes, settings.nats.host, opts.nats_port,
                           opts.nats_monitor_port, settings.nats.max_payload, settings.stack.bin_dir,
                           users, stack_nats_tls(settings))
        for node in nodes:
            rec, eps = start_nats(node, settings.stack.ready_timeout_s)
            state.processes.append(rec)
            state.endpoints += eps
            save_state(state)
        state.nats_url = ",".join(node.url for node in nodes)
    else:
        state.nats_url = check_external_nats(settings.nats_url)
        state.endpoints.append(Endpoint(name="nats", url=state.nats_url, check="nats"))
    save_state(state)


def _s3(settings: Settings, opts: UpOptions, state: StackState) -> S3Credentials:
    """Start the local S3 server (bucket created), or take the external one; returns the credentials."""
    state.s3_bucket = settings.s3.bucket
    if settings.s3_endpoint is None:
        creds = load_or_create_credentials(Path(state.state_dir))
        rec, ep = start_s3(Path(state.state_dir), settings.s3.host, opts.s3_port, creds, state.s3_bucket,
                           settings.stack.bin_dir, settings.stack.ready_timeout_s)
        state.processes.append(rec)
        state.s3_endpoint = f"{settings.s3.host}:{rec.ports[0]}"
    else:
        creds = _external_creds(settings)
        state.s3_endpoint = settings.s3_endpoint
        ep = Endpoint(name="s3", url=_http_url(state.s3_endpoint, settings.s3_secure), check="s3",
                      bucket=state.s3_bucket)
    state.endpoints.append(ep)
    save_state(state)
    return creds


def _stream_replicas(settings: Settings, opts: UpOptions) -> int:
    """settings.nats.replicas, at least 3 on a local cluster (the point of running one)."""
    if settings.nats_url is None and opts.nats_nodes > 1:
        return max(settings.nats.replicas, 3)
    return settings.nats.replicas


def _check_nats_nodes(settings: Settings, opts: UpOptions) -> None:
    n = opts.nats_nodes
    if not valid_nats_cluster_size(n):
        raise StackError(ExitCode.USAGE, f"--nats-cluster {n} (nats.cluster_nodes): use 1, or an odd number "
                                         "of nodes >= 3 (JetStream needs a majority of the nodes up)")
    if settings.nats_url is not None and n > 1:
        raise StackError(ExitCode.USAGE, f"--nats-cluster {n} starts local NATS nodes, but KVMESH_NATS_URL "
                                         "names an external NATS; unset one of them")
    replicas = _stream_replicas(settings, opts)
    if settings.nats_url is None and replicas > n:
        raise StackError(ExitCode.USAGE, f"nats.replicas {replicas} needs at least {replicas} NATS nodes "
                                         f"(--nats-cluster), not {n}")


def _preflight(settings: Settings, opts: UpOptions) -> None:
    """Everything checkable before the first start: NATS cluster size, binaries, ports, external servers."""
    _check_nats_nodes(settings, opts)
    ports: dict[int, str] = {}
    binaries: list[str] = []
    if settings.nats_url is None:
        binaries.append("nats-server")
        for port, flag in ((opts.nats_port, "--nats-port"), (opts.nats_monitor_port, "--nats-monitor-port")):
            if port:
                ports[port] = f"nats-server, {flag}"
    else:
        check_external_nats(settings.nats_url)
    if settings.s3_endpoint is None:
        binaries.append("weed")
        if opts.s3_port:
            ports[opts.s3_port] = "the S3 server, --s3-port"
    else:
        check_external_s3(settings.s3_endpoint, _external_creds(settings), settings.s3.bucket, settings.s3_secure)
    ensure_binaries(binaries, settings.stack.bin_dir)
    ensure_ports_free(ports, settings.nats.host)
    reserve(settings.ingress.port, *ports)  # no picked port may take a configured one before it binds


def _external_creds(settings: Settings) -> S3Credentials:
    if not (settings.s3_access_key and settings.s3_secret_key):
        raise StackError(ExitCode.USAGE, "KVMESH_S3_ENDPOINT needs KVMESH_S3_ACCESS_KEY and KVMESH_S3_SECRET_KEY")
    return S3Credentials(access_key=settings.s3_access_key, secret_key=settings.s3_secret_key)


def _http_url(endpoint: str, secure: bool) -> str:
    if "://" in endpoint:
        return endpoint
    host, port = host_port(endpoint, 443 if secure else 80)
    return f"{'https' if secure else 'http'}://{host}:{port}"


def _wait_ready(state: StackState, creds: S3Credentials, deadline: float, say: Callable[[str], None]) -> None:
    """Poll every endpoint until all are ready; a process that dies meanwhile fails the start at once.

    While some are not ready, every PROGRESS_S it names them with their logs' last line (vLLM's first start
    loads and compiles for minutes)."""
    pending = list(state.endpoints)
    started = last_said = time.monotonic()
    while pending:
        for rec in state.processes:
            if not is_ours(rec):
                raise StackError(ExitCode.START_FAILED, f"{rec.name} exited during start (log: {rec.log})")
        pending = [e for e in pending if not check_endpoint(e, creds).ready]
        now = time.monotonic()
        if pending and now > deadline:
            names = ", ".join(e.name for e in pending)
            raise StackError(ExitCode.START_FAILED, f"not ready before the deadline: {names} (logs: {state.state_dir})")
        if pending and now - last_said >= PROGRESS_S:
            last_said = now
            logs = {r.name: r.log for r in state.processes}
            say(f"waiting {now - started:.0f}s for " + "; ".join(
                f"{e.name}" + (f" ({last_line(logs[e.name])})" if logs.get(e.name) else "") for e in pending))
        if pending:
            time.sleep(0.1)


def last_line(path: str, width: int = 100) -> str:
    """The last non-empty line of a log file (a JSON line: its event), cut to `width` characters."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - 4096, 0))
            lines = [x.strip() for x in f.read().decode(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    if not lines:
        return ""
    try:
        line = str(json.loads(lines[-1]).get("event", lines[-1]))
    except (ValueError, AttributeError):
        line = lines[-1]
    return line[:width]


def _teardown(state: StackState, grace_s: float) -> None:
    """Stop everything started (services first), then forget the stack."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
    stop_in_order(state.processes, grace_s)
    remove_state(Path(state.state_dir))
