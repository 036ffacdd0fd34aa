"""Where a request decodes (shared/ingress/routing/placement.py): the priced rule, case by case."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given
from hypothesis import strategies as st
from kvmesh.ingress.routing.placement import PlacementCosts, decode_here
from kvmesh.ingress.routing.workers import WorkerView
from kvmesh.protocol.messages import Heartbeat, Role

PRICED = PlacementCosts(mode="priced", handoff_s_per_block=5e-3, decode_s_per_token=0.02)
BLOCK = 16


def view(role: Role, host: str, load: float = 0.0, in_flight: int = 0) -> WorkerView:
    hb = Heartbeat(worker_id=f"{role}-{host}", role=role, load=load, capacity=8, started_at=datetime.now(UTC),
                   http_endpoint=f"http://{host}:9000", seq=0, ttl_s=3.0)
    return WorkerView(hb, in_flight=in_flight)


def test_split_always_hands_off():
    split = PlacementCosts(mode="split")
    assert not decode_here(split, view(Role.PREFILL, "10.0.0.1"), view(Role.DECODE, "10.0.0.1"), 40, 8, BLOCK)
    assert not decode_here(split, view(Role.PREFILL, "10.0.0.1"), None, 40, 8, BLOCK)


def test_local_decodes_on_the_prefill_worker_even_when_a_decode_worker_pays():
    """vLLM workers (engine.backend vllm) decode their own requests: the KV is in vLLM's pool, not kvmesh's."""
    local = PlacementCosts(mode="local")
    busy = view(Role.PREFILL, "10.0.0.1", load=2, in_flight=2)
    assert not decode_here(PRICED, busy, view(Role.DECODE, "10.0.0.2"), 4000, 256, BLOCK)
    assert decode_here(local, busy, view(Role.DECODE, "10.0.0.2"), 4000, 256, BLOCK)
    assert decode_here(local, busy, None, 4000, 256, BLOCK)


def test_one_host_decodes_here_however_busy():
    """A decode worker on the prefill worker's host computes on the same cores: a handoff frees nothing."""
    busy = view(Role.PREFILL, "127.0.0.1", load=8, in_flight=8)
    assert decode_here(PRICED, busy, view(Role.DECODE, "127.0.0.1"), 8000, 512, BLOCK)


def test_no_live_decode_worker_decodes_here():
    assert decode_here(PRICED, view(Role.PREFILL, "10.0.0.1"), None, 4000, 256, BLOCK)


def test_idle_prefill_worker_keeps_the_decode():
    """Nothing queued behind it: the decode costs no one anything there, and the KV stays put."""
    assert decode_here(PRICED, view(Role.PREFILL, "10.0.0.1"), view(Role.DECODE, "10.0.0.2"), 4000, 256, BLOCK)


def test_busy_prefill_worker_hands_a_long_decode_off():
    # 250 blocks x 5 ms = 1.25 s moved, against 255 tokens x 20 ms x 4 queued = 20 s of others' waiting
    pf = view(Role.PREFILL, "10.0.0.1", load=2, in_flight=2)
    assert not decode_here(PRICED, pf, view(Role.DECODE, "10.0.0.2"), 4000, 256, BLOCK)
    # ... but not when the decode worker is busier still
    assert decode_here(PRICED, pf, view(Role.DECODE, "10.0.0.2", load=8, in_flight=4), 4000, 256, BLOCK)


def test_short_decode_stays_even_on_a_busy_worker():
    # 250 blocks x 5 ms = 1.25 s against 1 token x 20 ms x 4 queued = 0.08 s
    pf = view(Role.PREFILL, "10.0.0.1", load=2, in_flight=2)
    assert decode_here(PRICED, pf, view(Role.DECODE, "10.0.0.2"), 4000, 2, BLOCK)


@given(st.integers(1, 32_000), st.integers(1, 4096), st.integers(0, 16), st.integers(0, 16), st.integers(0, 16))
def test_more_decode_work_or_queue_never_moves_a_handoff_back_here(prompt, max_tokens, queued, more_tokens, more_queued):
    """Monotone: if a request is handed off, one with more tokens to decode, or a busier prefill worker, is too."""
    dc = view(Role.DECODE, "10.0.0.2")
    if not decode_here(PRICED, view(Role.PREFILL, "10.0.0.1", load=queued), dc, prompt, max_tokens, BLOCK):
        pf = view(Role.PREFILL, "10.0.0.1", load=queued + more_queued)
        assert not decode_here(PRICED, pf, dc, prompt, max_tokens + more_tokens, BLOCK)
