"""Message models: versioned, strict, round-trip; subject names reject unsafe tokens."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from kvmesh.protocol import subjects
from kvmesh.protocol.base import (
    Message,
    MessageDecodeError,
    ProtocolError,
    SchemaVersionError,
)
from kvmesh.protocol.messages import Heartbeat, Role


def _hb() -> Heartbeat:
    return Heartbeat(worker_id="prefill-1", role=Role.PREFILL, load=2.0, capacity=8.0,
                     started_at=datetime(2026, 1, 1, tzinfo=UTC), http_endpoint="http://127.0.0.1:9", seq=4, ttl_s=5.0)


def test_roundtrip_carries_the_schema_version():
    hb = _hb()
    raw = hb.to_bytes()
    assert b'"schema_version":1' in raw
    assert Heartbeat.from_bytes(raw) == hb


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_unknown_or_missing_version_is_rejected_clearly(version):
    raw = _hb().model_dump(mode="json") | {"schema_version": version}
    if version is None:
        del raw["schema_version"]
    with pytest.raises(SchemaVersionError, match="Heartbeat: .*schema_version.*this build speaks 1"):
        Heartbeat.from_bytes(json.dumps(raw).encode())


@pytest.mark.parametrize("patch", [{"load": "2"}, {"extra": 1}, {"role": "janitor"}, {"seq": -1}])
def test_strict_parsing(patch):
    raw = _hb().model_dump(mode="json") | patch
    with pytest.raises(MessageDecodeError):
        Heartbeat.from_bytes(json.dumps(raw).encode())


def test_garbage_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="Heartbeat: invalid payload"):
        Heartbeat.from_bytes(b"not json")


def test_a_bumped_model_rejects_the_old_version():
    class V1(Message):
        n: int

    class V2(Message):
        SCHEMA_VERSION = 2
        n: int

    assert V2(n=1).schema_version == 2
    with pytest.raises(SchemaVersionError, match="unsupported schema_version 1"):
        V2.from_bytes(V1(n=1).to_bytes())


def test_subject_tokens_are_validated():
    assert subjects.jobs_prefill("w-1") == "kvmesh.jobs.prefill.w-1"
    assert subjects.jobs_prefill() == "kvmesh.jobs.prefill.any"
    assert subjects.dead_letter("JOBS") == "kvmesh.dlq.JOBS"
    assert subjects.heartbeat_key("w_2") == "$KV.workers.w_2"
    for bad in ["", "a.b", "*", ">", "a b"]:
        with pytest.raises(ValueError):
            subjects.tokens(bad)
