"""The default policy: the session's order, a doorkeeper for new blocks no session vouches for."""

from __future__ import annotations

import random

from kvmesh.cache_policy.base import BlockInfo
from kvmesh.cache_policy.default import DefaultPolicy
from kvmesh.sessions.events import TurnOutcome
from kvmesh.sim.run import run_one
from kvmesh.sim.trace import TRACE_BLOCK_TOKENS, Trace, TraceRequest

from tests.policy.agent_trace import agent_trace


def _info(h: bytes, t: float) -> BlockInfo:
    return BlockInfo(h, None, 0, 16, 1024, t, t)


def test_a_block_ranks_by_its_session_only_where_the_session_vouches_for_it() -> None:
    p = DefaultPolicy()
    p.book.turn_started("named", [b"n1"], 0.0, explicit=True)
    p.book.turn_started("guessed", [b"g1"], 0.0)
    for h in (b"n1", b"g1", b"nobody"):
        p.on_access(h, 0.0)
    assert not p.book.inference.trusted  # no evidence yet: inferred sessions do not vouch
    assert p.vouched(b"n1") and not p.vouched(b"g1") and not p.vouched(b"nobody")
    new = p.priority(_info(b"nobody", 0.0), 0.0)  # seen once, vouched for by no session: the lowest band
    assert new < p.priority(_info(b"n1", 0.0), 0.0)

    for k in range(1, 200):  # the guessed session keeps coming back, sending what it sent before and more
        p.book.turn_started("guessed", [b"g1", *(bytes([j % 256, 2]) for j in range(k))], float(k))
        p.book.turn_ended("guessed", k + 0.5, TurnOutcome.TOOL_CALLS, ["bash"])
    assert p.book.inference.trusted and p.vouched(b"g1")
    for k in range(300):  # then inferred sessions that never come back: a new one every turn
        p.book.turn_started(f"one-off-{k}", [bytes([k % 256, 1])], 200.0 + k)
        p.book.turn_ended(f"one-off-{k}", 200.5 + k, TurnOutcome.ANSWER)
    assert not p.book.inference.trusted
    assert p.vouched(b"n1") and not p.vouched(b"g1")  # the named session still vouches; the guessed one no longer
    assert p.pin_after_turn("guessed", 600.0) is None  # nor is it pinned
    assert p.priority(_info(b"g1", 0.0), 0.0) == new  # ranked like a new block of no session
    p.on_access(b"g1", 500.0)
    assert p.priority(_info(b"g1", 0.0), 0.0) > new  # requested twice: out of the lowest band


def test_inferred_sessions_that_drop_their_blocks_are_not_trusted() -> None:
    """Inference that merges unrelated prompts into one session: each turn sends little of what it sent before."""
    p = DefaultPolicy()
    for k in range(200):
        p.book.turn_started("merged", [b"sys", bytes([k % 256, 7])], float(k))
        p.book.turn_ended("merged", k + 0.5, TurnOutcome.TOOL_CALLS, ["bash"])
    assert p.book.inference.returning.share > 0.9 and p.book.inference.resent.share < 0.6
    assert not p.book.inference.trusted


def _strip_sessions(trace: Trace) -> Trace:
    return Trace(trace.name + "-anonymous", tuple(
        TraceRequest(r.time_s, r.input_length, r.output_length, r.blocks, None, r.tool_calls, r.block_size)
        for r in trace.requests))


def _conversations(seed: int, requests: int = 2500) -> Trace:
    """No session ids: prompts under a few shared prefixes (Zipf), most with a one-off tail, some
    re-sent minutes later with a few more blocks (a conversation's next message)."""
    rng = random.Random(seed)
    prefixes = [[rng.getrandbits(60).to_bytes(8, "big") for _ in range(rng.randint(2, 8))] for _ in range(40)]
    weights = [1 / (k + 1) for k in range(len(prefixes))]
    open_chats: list[list[bytes]] = []
    out = []
    for i in range(requests):
        if open_chats and rng.random() < 0.3:
            chain = rng.choice(open_chats)
            chain += [rng.getrandbits(60).to_bytes(8, "big") for _ in range(rng.randint(1, 3))]
        else:
            chain = rng.choices(prefixes, weights)[0] + [rng.getrandbits(60).to_bytes(8, "big")
                                                         for _ in range(rng.randint(1, 6))]
            if rng.random() < 0.2:
                open_chats.append(chain)
        out.append(TraceRequest(i * 0.5, len(chain) * TRACE_BLOCK_TOKENS - 3, 30, tuple(chain)))
    return Trace("conversations", tuple(out))


def _rates(trace: Trace, names: tuple[str, ...], fraction: float) -> dict[str, float]:
    capacity = max(1, round(fraction * trace.unique_blocks))
    return {n: run_one(trace, n, capacity).hit_rate for n in names}


def test_without_session_ids_the_default_is_never_worse_than_lru() -> None:
    """Two no-session traces: conversations under shared prefixes (few come back), and agents whose ids
    were stripped (their sessions inferred). At every capacity: default >= lru - 0.01."""
    for trace in (_conversations(seed=3), _strip_sessions(agent_trace(sessions=120, seed=2))):
        for fraction in (0.02, 0.06, 0.3):
            r = _rates(trace, ("default", "lru"), fraction)
            assert r["default"] >= r["lru"] - 0.01, (trace.name, fraction, r)


def test_session_signals_move_it_to_the_session_order() -> None:
    """With session ids (a generated agent trace) the default ranks as `session` does, well above the
    doorkeeper alone (`cost`) and LRU where the pool is small."""
    trace = agent_trace(sessions=200, seed=1, start_rate_s=1.0)
    r = _rates(trace, ("default", "session", "cost", "lru"), 0.04)
    assert abs(r["default"] - r["session"]) <= 0.01, r
    assert r["default"] >= 1.2 * max(r["cost"], r["lru"]), r


def test_a_session_named_after_its_blocks_arrived_is_re_ranked() -> None:
    """A worker may bind a job's blocks before the started event says the client named the session: once
    it does, those blocks are handed back for re-keying, so they leave the unvouched band at once."""
    p = DefaultPolicy()
    p.book.turn_started("agent", [b"a1", b"a2"], 0.0)  # the job: named or not is not known yet
    p.book.take_changed()
    p.on_access(b"a1", 0.0)
    before = p.priority(_info(b"a1", 0.0), 0.0)
    p.book.turn_announced("agent", 0.1, explicit=True)  # the started event: the client named it
    assert {b"a1", b"a2"} <= p.book.take_changed()
    assert p.priority(_info(b"a1", 0.0), 0.1) > before
