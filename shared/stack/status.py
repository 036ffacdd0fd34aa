"""`kvmesh status` and `kvmesh down`: read the state file, report or stop what it records."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvmesh.config import Settings
from kvmesh.credentials.s3 import S3Credentials, read_credentials
from kvmesh.serving.audit_status import read_audit_counts
from kvmesh.stack.belady_status import read_live_belady
from kvmesh.stack.probe import EndpointStatus, check_endpoint
from kvmesh.stack.procs import (
    ProcessStatus,
    is_ours,
    launcher_alive,
    process_status,
    stop_in_order,
)
from kvmesh.stack.servers import stop_pid
from kvmesh.stack.state import ProcessRecord, StackState, load_state, remove_state


@dataclass(slots=True)
class StackStatus:
    state_dir: str
    running: bool  # a state file exists and at least one recorded process is alive
    ready: bool  # every process alive and every endpoint ready
    starting: bool = False  # `kvmesh up` has not finished its readiness wait yet
    processes: list[ProcessStatus] = field(default_factory=list)
    endpoints: list[EndpointStatus] = field(default_factory=list)
    cache_audit: dict[str, int] = field(default_factory=dict)  # audited / mismatches over the decode workers
    cache_belady: dict[str, float] = field(default_factory=dict)  # live Belady gauges of the eviction service

    @property
    def rss_total_bytes(self) -> int:
        return sum(p.rss_bytes for p in self.processes)

    def to_json(self) -> dict:
        return {**asdict(self), "rss_total_bytes": self.rss_total_bytes}


def stack_status(settings: Settings, state_dir: Path) -> StackStatus:
    state_dir = state_dir.resolve()
    state = load_state(state_dir)
    if state is None:
        return StackStatus(state_dir=str(state_dir), running=False, ready=False)
    procs = [process_status(r) for r in state.processes]
    creds = _s3_credentials(settings, state, state_dir)
    endpoints = [check_endpoint(e, creds) for e in state.endpoints]
    running = any(p.alive for p in procs) or (not procs and all(e.reachable for e in endpoints))
    ready = all(p.alive for p in procs) and all(e.ready for e in endpoints) and state.ready_at is not None
    starting = state.ready_at is None and launcher_alive(state)
    http = [(e.name, e.url) for e in state.endpoints if e.check == "http"]
    audit = read_audit_counts(http)
    return StackStatus(str(state_dir), running, ready, starting, procs, endpoints, audit.as_dict(),
                       read_live_belady(http))


def _s3_credentials(settings: Settings, state: StackState, state_dir: Path) -> S3Credentials | None:
    if any(r.name == "s3" for r in state.processes):
        return read_credentials(state_dir)
    if settings.s3_access_key and settings.s3_secret_key:
        return S3Credentials(settings.s3_access_key, settings.s3_secret_key)
    return None


def stack_down(state_dir: Path, grace_s: float) -> list[str] | None:
    """Stop the recorded stack (services first), remove its state file, and name what was alive.

    None when no stack was recorded; an empty list when the record was stale (nothing alive).

    A `kvmesh up` still holding the stack (foreground, or mid-start) is sent SIGTERM first, so it
    stops what it started itself and does not go on starting more.
    """
    state_dir = state_dir.resolve()
    state = load_state(state_dir)
    if state is None:
        return None
    alive = [r.name for r in state.processes if is_ours(r)]
    if launcher_alive(state) and state.launcher_pid != os.getpid():
        stop_pid(state.launcher_pid, grace_s * 3)  # its own teardown takes up to two grace periods
    later = _recorded_since(state_dir)
    alive += [r.name for r in later if r.name not in alive and is_ours(r)]
    stop_in_order(state.processes + later, grace_s)
    remove_state(state_dir)
    return alive


def _recorded_since(state_dir: Path) -> list[ProcessRecord]:
    """Processes a launcher recorded after we first read the state (it may have been mid-start)."""
    later = load_state(state_dir)
    return later.processes if later is not None else []

