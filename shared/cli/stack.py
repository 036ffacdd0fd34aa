"""`kvmesh up`, `kvmesh status`, `kvmesh down`: the local stack from one command line.

Known failures print one line on stderr and exit with a distinct code
(kvmesh.stack.errors.ExitCode); stack modules are imported inside the
commands so `kvmesh --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from kvmesh.stack.errors import EXIT_CODES_HELP, ExitCode, StackError

StateDir = Annotated[
    Path | None, typer.Option("--state-dir", help="Default: settings state_dir (KVMESH_STATE_DIR, .kvmesh).")
]


def register(app: typer.Typer) -> None:
    app.command(epilog=EXIT_CODES_HELP)(up)
    app.command(epilog=EXIT_CODES_HELP)(status)
    app.command(epilog=EXIT_CODES_HELP)(down)


def _fail(command: str, code: ExitCode, message: str) -> typer.Exit:
    typer.echo(f"kvmesh {command}: {message}", err=True)
    return typer.Exit(int(code))


def _settings(command: str):
    from kvmesh.config import load_settings
    from pydantic import ValidationError

    try:
        return load_settings()
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise _fail(command, ExitCode.USAGE, f"bad setting {where}: {err['msg']}") from None


def _replicas(prefill: int | None, decode: int | None, pairs: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for pair in pairs:
        name, _, n = pair.partition("=")
        if not n.isdigit():
            raise _fail("up", ExitCode.USAGE, f"--replicas wants NAME=N, got {pair!r}")
        counts[name] = int(n)
    counts.update({k: v for k, v in (("prefill", prefill), ("decode", decode)) if v is not None})
    return counts


def up(
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return once ready; the stack keeps running.")] = False,
    fresh: Annotated[bool, typer.Option(help="Wipe the JetStream store and S3 data first.")] = False,
    model: Annotated[Path | None, typer.Option(
        help="Checkpoint dir. Default: SmolLM2-135M-Instruct, imported once into the state dir.")] = None,
    preset: Annotated[str | None, typer.Option(
        help="Serve a random-weight preset instead (agent: 32k positions; llama3-8b, llama3-70b: real KV geometry).")] = None,
    prefill: Annotated[int | None, typer.Option(min=0, help="Prefill replicas.")] = None,
    decode: Annotated[int | None, typer.Option(min=0, help="Decode replicas.")] = None,
    replicas: Annotated[list[str], typer.Option(help="NAME=N replicas of a service (repeatable).")] = [],  # noqa: B006
    nats_port: Annotated[int | None, typer.Option(help="0 picks a free port. Default: settings nats.port.")] = None,
    nats_monitor_port: Annotated[int | None, typer.Option(help="Default: settings nats.monitor_port.")] = None,
    s3_port: Annotated[int | None, typer.Option(help="0 picks a free port. Default: settings s3.port.")] = None,
    nats_cluster: Annotated[int | None, typer.Option(
        help="NATS nodes: 1, or an odd number >= 3 routed to each other (streams R3). "
             "Default: settings nats.cluster_nodes.")] = None,
    engine: Annotated[str | None, typer.Option(
        help="What computes tokens: vllm (vLLM in each worker, kvmesh's connector as its KV layer; needs vLLM "
             "installed here), native (kvmesh's own engine), or auto (vllm where installed, else native). "
             "Default: settings engine.backend (auto).")] = None,
    timeout: Annotated[float | None, typer.Option(help="Readiness deadline in seconds.")] = None,
    state_dir: StateDir = None,
) -> None:
    """Start NATS, the S3 server and every kvmesh service; print the endpoints once all are ready.

    Without --detach it stays in the foreground; Ctrl-C, SIGTERM or SIGHUP stops everything.

    A second `up` on a state dir whose stack is running exits with code 3 and changes nothing.

    KVMESH_NATS_URL / KVMESH_S3_ENDPOINT (+ _ACCESS_KEY, _SECRET_KEY) use those servers instead.
    """
    from kvmesh.stack.up import UpOptions
    from kvmesh.stack.up import up as stack_up

    settings = _settings("up")
    if timeout is not None:
        settings.stack.ready_timeout_s = timeout
    if engine is not None:
        if engine not in ("auto", "vllm", "native"):
            raise _fail("up", ExitCode.USAGE, f"--engine is auto, vllm or native, not {engine!r}")
        settings.engine.backend = engine
    opts = UpOptions(
        state_dir=state_dir or settings.state_dir,
        detach=detach,
        fresh=fresh,
        model_dir=model,
        preset=preset,
        replicas=_replicas(prefill, decode, replicas),
        nats_port=settings.nats.port if nats_port is None else nats_port,
        nats_monitor_port=settings.nats.monitor_port if nats_monitor_port is None else nats_monitor_port,
        s3_port=settings.s3.port if s3_port is None else s3_port,
        nats_nodes=settings.nats.cluster_nodes if nats_cluster is None else nats_cluster,
    )
    try:
        stack_up(settings, opts, typer.echo)
    except StackError as exc:
        raise _fail("up", exc.code, exc.message) from None
    except KeyboardInterrupt:
        raise _fail("up", ExitCode.START_FAILED, "interrupted during start; everything started was stopped") from None


def status(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    state_dir: StateDir = None,
) -> None:
    """Report each process (pid, alive, rss with its children, cores, uptime) and endpoint (reachable, ready);
    exit 0 only if all ready."""
    from kvmesh.stack.status import stack_status

    settings = _settings("status")
    st = stack_status(settings, state_dir or settings.state_dir)
    if as_json:
        typer.echo(json.dumps(st.to_json(), indent=2))
    else:
        word = "ready" if st.ready else "starting" if st.starting else "degraded" if st.running else "not running"
        typer.echo(f"kvmesh stack ({st.state_dir}): {word}")
        for p in st.processes:
            typer.echo(f"  {p.name:<14} pid {p.pid:<8} {'alive' if p.alive else 'DEAD ':<6}"
                       f" rss {p.rss_bytes / 2**20:7.1f} MiB  cpus {p.cpus or '-':<6} up {p.uptime_s:8.1f}s"
                       + (f"  (+{p.children} child processes)" if p.children else ""))
        for e in st.endpoints:
            typer.echo(f"  {e.name:<14} {e.url:<34} {'reachable' if e.reachable else 'UNREACHABLE'}"
                       f" {'ready' if e.ready else 'NOT READY'}")
        if st.processes:
            typer.echo(f"  total rss {st.rss_total_bytes / 2**20:.1f} MiB")
        if st.cache_audit.get("workers_read"):
            typer.echo(f"  cache audit: {st.cache_audit['audited']} audited, {st.cache_audit['mismatches']} mismatches")
        if (b := st.cache_belady).get("window_accesses"):
            typer.echo(f"  cache hit rate: actual {b['actual']:.3f} (any tier {b['actual_any']:.3f}), belady "
                       f"{b['belady']:.3f}, infinite {b['infinite']:.3f}; actual/belady {b['belady_ratio']:.2f} "
                       f"over {int(b['window_accesses'])} block accesses, {int(b['capacity_blocks'])} L1 blocks")
    raise typer.Exit(int(ExitCode.OK if st.ready else ExitCode.NOT_READY))


def down(
    grace: Annotated[float | None, typer.Option(help="Seconds between SIGTERM and SIGKILL.")] = None,
    state_dir: StateDir = None,
) -> None:
    """Stop services, then NATS and S3 (SIGTERM, SIGKILL after the grace period); data stays for the next `up`."""
    from kvmesh.stack.status import stack_down

    settings = _settings("down")
    target = (state_dir or settings.state_dir).resolve()
    stopped = stack_down(target, settings.stack.stop_grace_s if grace is None else grace)
    if stopped is None:
        typer.echo(f"no kvmesh stack is running from {target}")
    elif not stopped:
        typer.echo(f"no kvmesh stack is running from {target} (removed a stale record of one)")
    else:
        typer.echo(f"stopped {len(stopped)} processes from {target}: {', '.join(stopped)}")
