"""What can go wrong when running the local stack, each with its own exit code.

The CLI prints ``StackError.message`` as one line on stderr and exits with
``StackError.code``; no traceback reaches the user for these situations.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes of `kvmesh up / status / down` (documented in the CLI help)."""

    OK = 0
    NOT_READY = 1  # status: not running, or running but degraded
    USAGE = 2  # bad arguments or settings (typer uses 2 as well)
    ALREADY_RUNNING = 3
    PORT_IN_USE = 4
    BINARY_MISSING = 5
    UNREACHABLE = 6  # an external server (KVMESH_NATS_URL / KVMESH_S3_ENDPOINT) did not answer
    STATE_DIR = 7  # the state dir cannot be created or written
    START_FAILED = 8  # a process exited during start, or was not ready before the deadline


EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 1 not running or degraded (status); 2 usage; 3 already running; "
    "4 port in use; 5 binary missing; 6 external server unreachable; "
    "7 state dir not writable; 8 a process failed to start or get ready."
)


class StackError(Exception):
    """A failure the user can act on: one line of text and an exit code."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
