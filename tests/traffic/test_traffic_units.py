"""The traffic record, its trace lines, the ingress's record builder and the live Belady window (no bus)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.eviction.access_window import KEY_BYTES, AccessWindow, as_trace
from kvmesh.eviction.live_belady import compute
from kvmesh.ingress.sessions.traffic import cache_writes
from kvmesh.protocol.base import ProtocolError
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.serving import CachePin
from kvmesh.protocol.traffic import TrafficRecord, hash_id, session_tag, tenant_tag
from kvmesh.sim.run import run_one
from kvmesh.sim.trace import block_key, load_trace, parse_line
from kvmesh.traffic.tiers import tier_tokens
from kvmesh.traffic.trace_lines import to_trace_line, trace_lines, write_trace


def rec(at: float, ids: list[int], cached: int = 0, block_tokens: int = 16, **kw) -> TrafficRecord:
    return TrafficRecord(at=at, input_length=block_tokens * len(ids) + 3, output_length=5, hash_ids=ids,
                         block_tokens=block_tokens, tenant=tenant_tag("t"), api="openai.chat", cached_tokens=cached,
                         **kw)


def test_ids_and_tags_are_stable_and_scoped() -> None:
    h = bytes(range(32))
    assert hash_id(h) == int.from_bytes(h[:8], "big") and block_key(hash_id(h)) == h[:8]  # top bit clear here
    assert hash_id(b"\xff" * 32) == 2**63 - 1
    with pytest.raises(ProtocolError):
        TrafficRecord.from_bytes(rec(0.0, [1]).to_bytes().replace(b'"hash_ids":[1]', b'"hash_ids":[9223372036854775808]'))
    assert tenant_tag("acme") == tenant_tag("acme") != tenant_tag("other") and "acme" not in tenant_tag("acme")
    assert session_tag("a", "chat-1") != session_tag("b", "chat-1") and len(session_tag("a", "x")) == 16


def test_record_round_trips_the_wire_and_reads_as_a_sim_line() -> None:
    r = rec(100.0, [1, 2, 3], cached=32, session_id=session_tag("t", "s"), tool_calls=["get_weather"],
            tier_tokens={"l1": 16, "l2": 16, "peer": 0, "l3": 0}, cache_write_tokens={"300": 16}, ttft_ms=12.5)
    assert TrafficRecord.from_bytes(r.to_bytes()) == r
    line = to_trace_line(r, origin=99.5)
    assert line["timestamp"] == 500 and "schema_version" not in line
    req = parse_line(json.dumps(line))
    assert req.blocks == tuple(block_key(i) for i in (1, 2, 3)) and req.block_size == 16
    assert req.session_id == r.session_id and req.tool_calls == ("get_weather",)
    assert [req.block_tokens(k) for k in range(3)] == [16, 16, 16]  # the partial tail is not a hash id
    assert r.hit_blocks() == 2 and r.l1_hit_blocks() == 1


def test_sim_lines_without_block_tokens_keep_mooncake_blocks() -> None:
    req = parse_line('{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3]}')
    assert req.block_size == 512 and req.block_tokens(2) == 76


def test_trace_is_in_arrival_order_timed_from_the_first(tmp_path: Path) -> None:
    records = [rec(10.25, [3]), rec(10.0, [1, 2]), rec(12.0, [1, 2, 4])]
    assert [line["timestamp"] for line in trace_lines(records)] == [0, 250, 2000]
    assert write_trace(records, tmp_path / "t.jsonl") == 3
    trace = load_trace(tmp_path / "t.jsonl")
    assert [len(r.blocks) for r in trace.requests] == [2, 1, 3] and trace.unique_blocks == 4


def test_tier_tokens_sum_to_cached_in_resolver_order() -> None:
    assert tier_tokens({Tier.L1: 2, Tier.L2: 1, Tier.L3: 3}, 16, 80) == {"l1": 32, "l2": 16, "peer": 0, "l3": 32}
    assert tier_tokens({}, 16, 48) == {"l1": 48, "l2": 0, "peer": 0, "l3": 0}  # found by the engine itself
    assert sum(tier_tokens({Tier.PEER: 9}, 16, 40).values()) == 40


def test_cache_writes_split_by_ttl_past_the_cached_prefix() -> None:
    pins = [CachePin(num_tokens=64, ttl_s=3600.0), CachePin(num_tokens=160, ttl_s=300.0)]
    assert cache_writes(pins, cached_tokens=32, created_tokens=128) == {"3600": 32, "300": 96}
    assert cache_writes(pins, cached_tokens=96, created_tokens=64) == {"3600": 0, "300": 64}
    assert cache_writes(pins, cached_tokens=0, created_tokens=48) == {"3600": 48, "300": 0}  # what was written
    assert cache_writes([], 0, 0) == {}


chains = st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=12), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(chains, st.integers(1, 30), st.floats(0.5, 50.0))
def test_window_never_exceeds_its_bounds_and_keeps_the_newest(ids: list[list[int]], max_accesses: int,
                                                              max_age: float) -> None:
    window = AccessWindow(max_accesses, max_age)
    for i, chain in enumerate(ids):
        window.add(rec(float(i), chain))
        kept = window.snapshot()
        assert window.accesses == sum(e.count for e in kept) <= max_accesses
        assert all(e.at >= i - max_age for e in kept)
        assert kept[-1].at == i  # the newest is always kept (cut to the bound if it alone is over)
        assert kept[-1].blocks == b"".join(h.to_bytes(KEY_BYTES, "big") for h in chain[:max_accesses])
        assert [e.at for e in kept] == [float(j) for j in range(i - len(kept) + 1, i + 1)]  # a suffix
    assert window.dropped + len(window) == len(ids)


def test_window_memory_is_8_bytes_an_access() -> None:
    window = AccessWindow(1000, 3600.0)
    window.add(rec(0.0, list(range(100))))
    assert len(window.snapshot()[0].blocks) == 8 * 100


@settings(max_examples=25, deadline=None)
@given(chains, st.integers(1, 20))
def test_live_belady_is_the_sims_belady_on_the_same_requests(ids: list[list[int]], capacity: int) -> None:
    # chains of prefixes: a request's ids are a chain, so make each one a prefix-closed walk
    records = [rec(float(i), [hash_id(hashlib.sha256(bytes(c[:k + 1])).digest()) for k in range(len(c))])
               for i, c in enumerate(ids)]
    window = AccessWindow(10_000, 1e9)
    for r in records:
        window.add(r)
    result = compute(window.snapshot(), capacity)
    trace = as_trace(window.snapshot())
    assert result.belady == run_one(trace, "belady", capacity).hit_rate
    assert result.infinite == run_one(trace, "infinite", capacity).hit_rate
    assert result.accesses == sum(len(r.hash_ids) for r in records)
    assert 0.0 <= result.belady <= result.infinite <= 1.0


def test_actual_counts_whole_blocks_per_tier() -> None:
    window = AccessWindow(100, 100.0)
    window.add(rec(0.0, [1, 2, 3, 4]))
    window.add(rec(1.0, [1, 2, 3, 5], cached=48, tier_tokens={"l1": 16, "l2": 32, "peer": 0, "l3": 0}))
    r = compute(window.snapshot(), 8)
    assert (r.actual, r.actual_any) == (1 / 8, 3 / 8)
    assert r.belady == r.infinite == 3 / 8 and r.belady_ratio == pytest.approx(1 / 3)
