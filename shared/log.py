"""Structured logging: one JSON object per line on stderr, for every logger in the process.

`configure_logging` runs once at process start (the service runner calls it).
It binds `service` and `worker_id` to every record and routes stdlib logging
(nats, uvicorn, asyncio) through the same structlog processors, so a log line
from nats-py and one from kvmesh look alike. Per-request fields
(`request_id`, `session_id`) live in contextvars: `bind_request(...)` binds
them for the code running inside it, including tasks it starts.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import structlog
from kvmesh.protocol import subjects

# Loggers of libraries that are chatty at INFO; kept one level quieter than ours.
_QUIET_LIBRARIES = ("uvicorn.access", "asyncio")


def _shared_processors() -> list[structlog.typing.Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]


def configure_logging(level: str = "info", service: str = "", worker_id: str = "") -> None:
    """Send structlog and stdlib logging as JSON lines to stderr at `level`.

    Calling it again replaces the previous setup (tests reconfigure freely);
    `service` and `worker_id` become context variables bound for the process.
    """
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning, error or critical")

    structlog.configure(
        processors=[
            *_shared_processors(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_shared_processors(),
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.JSONRenderer(),
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    for name in _QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING))
    # uvicorn installs its own handlers; let its records propagate to ours instead.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True

    structlog.contextvars.clear_contextvars()
    identity = {k: v for k, v in (("service", service), ("worker_id", worker_id)) if v}
    structlog.contextvars.bind_contextvars(**identity)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A logger named after its module; fields bound by `bind_request` are added automatically."""
    return structlog.stdlib.get_logger(name)


@contextmanager
def bind_request(request_id: str | None = None, session_id: str | None = None, **fields: object) -> Iterator[None]:
    """Bind request-scoped fields for everything logged inside the block (contextvars, task-safe)."""
    values = {"request_id": request_id, "session_id": session_id, **fields}
    with structlog.contextvars.bound_contextvars(**{k: v for k, v in values.items() if v is not None}):
        yield


# Log fields that travel with a message as headers, so the next service logs them too.
_PROPAGATED = {"request_id": subjects.HDR_REQUEST_ID, "session_id": subjects.HDR_SESSION_ID}


def propagation_headers() -> dict[str, str]:
    """Headers for an outgoing message: the request/session ids bound in the current context."""
    bound = structlog.contextvars.get_contextvars()
    return {hdr: str(bound[field]) for field, hdr in _PROPAGATED.items() if bound.get(field)}


def fields_from_headers(headers: dict[str, str] | None) -> dict[str, str]:
    """The request/session ids an incoming message carries, as log fields (for `bind_request`)."""
    headers = headers or {}
    return {field: headers[hdr] for field, hdr in _PROPAGATED.items() if headers.get(hdr)}
