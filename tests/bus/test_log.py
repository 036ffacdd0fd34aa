"""Logging: JSON lines on stderr with service, worker and request fields; stdlib loggers routed through."""

from __future__ import annotations

import json
import logging

import pytest
import structlog
from kvmesh.log import bind_request, configure_logging, get_logger


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def test_json_lines_with_bound_fields(capsys, restore_logging):
    configure_logging("info", service="prefill", worker_id="p-1")
    log = get_logger("kvmesh.test")
    with bind_request(request_id="r-1", session_id="s-9"):
        log.info("prefill done", blocks=3)
        logging.getLogger("nats.aio.client").warning("reconnecting")  # a library's stdlib logger
    log.debug("hidden at info")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert len(lines) == 2
    ours, theirs = lines
    assert ours["event"] == "prefill done" and ours["blocks"] == 3 and ours["level"] == "info"
    for rec in lines:
        assert (rec["service"], rec["worker_id"], rec["request_id"], rec["session_id"]) == ("prefill", "p-1", "r-1", "s-9")
    assert theirs["logger"] == "nats.aio.client" and theirs["level"] == "warning"


def test_unknown_level_is_rejected(restore_logging):
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("loud")
