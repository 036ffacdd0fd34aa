"""The stack's state file: which processes `kvmesh up` started, their ports and endpoints.

It lives at ``<state_dir>/stack.json`` while a stack runs and is removed by
``kvmesh down``. Each process is recorded with its kernel start time
(``/proc/<pid>/stat`` field 22), so a recycled PID is never mistaken for
ours and never signalled.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

STATE_FILE = "stack.json"
SCHEMA_VERSION = 1


class ProcessRecord(BaseModel):
    """One child process of the stack."""

    name: str  # "nats", "s3", "<service>-<replica>"
    kind: Literal["server", "service"]
    pid: int
    start_ticks: int  # kernel start time of the PID, guards against PID reuse
    started_at: float  # unix seconds
    log: str  # log file path
    ports: list[int] = Field(default_factory=list)  # every port it listens on


class Endpoint(BaseModel):
    """Something a client connects to, and how to check it is ready."""

    name: str
    url: str
    check: Literal["nats", "http", "s3"]  # nats: INFO banner; http: GET url+ready_path -> 200; s3: bucket exists
    ready_path: str = ""  # for check == "http"
    bucket: str | None = None  # for check == "s3"


class StackState(BaseModel):
    """Everything `status` and `down` need, written by `up`."""

    version: int = SCHEMA_VERSION
    state_dir: str
    launcher_pid: int  # the `kvmesh up` process; a foreground one holds the stack until it ends
    launcher_ticks: int
    detached: bool
    started_at: float = Field(default_factory=time.time)
    ready_at: float | None = None
    nats_url: str = ""  # what services are given: every node of a local cluster, comma separated
    s3_endpoint: str = ""  # host:port, the form the minio SDK takes
    s3_bucket: str = ""
    processes: list[ProcessRecord] = Field(default_factory=list)
    endpoints: list[Endpoint] = Field(default_factory=list)


def state_path(state_dir: Path) -> Path:
    return state_dir / STATE_FILE


def load_state(state_dir: Path) -> StackState | None:
    """The recorded stack, or None when there is no (readable) state file."""
    try:
        return StackState.model_validate_json(state_path(state_dir).read_text())
    except (OSError, ValueError):
        return None


def claim_state(state: StackState) -> bool:
    """Create the state file only if there is none; False when another `up` got there first."""
    try:
        fd = os.open(state_path(Path(state.state_dir)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(state.model_dump(), indent=2))
    return True


def save_state(state: StackState) -> None:
    """Write atomically (tmp file + rename) so a reader never sees half a file."""
    path = state_path(Path(state.state_dir))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state.model_dump(), indent=2))
    os.replace(tmp, path)


def remove_state(state_dir: Path) -> None:
    for p in (state_path(state_dir), state_path(state_dir).with_suffix(".json.tmp")):
        p.unlink(missing_ok=True)
