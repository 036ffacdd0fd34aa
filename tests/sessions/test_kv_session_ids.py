"""KV events name the session whose job stored a run: the field, its wire version, and coalescing."""

from __future__ import annotations

import pytest
from kvmesh.kv_events.event_log import EventLog
from kvmesh.kv_events.events import BlockStored, KVEventBatch
from kvmesh.protocol.base import SchemaVersionError
from kvmesh.protocol.blocks import Tier


def _h(i: int) -> bytes:
    return bytes([i]) * 32


def test_runs_of_different_sessions_stay_apart() -> None:
    log = EventLog("w-1", epoch=1)
    log.stored([_h(1)], Tier.L2, tokens_per_block=16, session_id="s-a")
    log.stored([_h(2)], Tier.L2, parent=_h(1), tokens_per_block=16, session_id="s-a")  # joins: same session
    log.stored([_h(3)], Tier.L2, parent=_h(2), tokens_per_block=16, session_id="s-b")  # another session
    log.stored([_h(4)], Tier.L1, parent=_h(3), tokens_per_block=16)  # the engine's own store: no session
    batch = log.take_batch()
    assert batch is not None
    stored = [(e.hashes, e.session_id) for e in KVEventBatch.from_bytes(batch.to_bytes()).events]
    assert stored == [([_h(1).hex(), _h(2).hex()], "s-a"), ([_h(3).hex()], "s-b"), ([_h(4).hex()], None)]


def test_the_field_is_a_new_wire_version() -> None:
    ev = BlockStored(seq=1, hashes=[_h(1).hex()], tokens_per_block=16, tier=Tier.L2, session_id="s-a")
    assert ev.schema_version == 2
    old = ev.to_bytes().replace(b'"schema_version":2', b'"schema_version":1')
    with pytest.raises(SchemaVersionError):
        BlockStored.from_bytes(old)
