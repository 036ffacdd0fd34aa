"""A worker's session-aware eviction: session events over a real NATS stream re-rank its engine's own evictions.

Two sessions leave blocks in a small pool: one went to run a tool (back in
seconds), then the other answered (its person replies in an hour). Under
LRU the tool-call session, the least recently used, is evicted first by the
next prompt that needs room; with `eviction_policy=session` and the feed,
the idle session goes and the tool-call session's next turn is an L1 hit
that answers exactly as a cold run (cache transparency).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from bus.helpers import connected, eventually
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.sampling import SamplingParams
from kvmesh.protocol import subjects
from kvmesh.serving.engine_loop import EngineLoop
from kvmesh.serving.session_feed import SessionFeed
from kvmesh.sessions.events import SessionEvent, TurnOutcome

BS = 8
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
TOOL = [(5 * i + 1) % 400 + 7 for i in range(6 * BS)]
IDLE = [(11 * i + 2) % 400 + 7 for i in range(6 * BS)]
CHURN = [(13 * i + 5) % 400 + 7 for i in range(6 * BS)]


def ended(session: str, outcome: TurnOutcome, hint_s: float) -> SessionEvent:
    return SessionEvent(tenant="t", session_id=session, request_id=f"r-{session}", outcome=outcome,
                        tools=["bash"] if outcome is TurnOutcome.TOOL_CALLS else [], at=time.time(),
                        expected_return_ms=int(hint_s * 1000))


async def run_turns(loaded, policy: str, url: str | None) -> tuple[int, list[int]]:
    """Both sessions' turns, a churn prompt, then the tool session's next turn: (its cached tokens, its tokens)."""
    engine = Engine(loaded, EngineSettings(block_size=BS, num_blocks=14, eviction_policy=policy))
    loop = EngineLoop(engine)
    loop.start()
    try:
        feed = SessionFeed(loop, engine.cache.policy) if policy == "session" else None
        async with connected(url, "feed") as nc:
            if feed is not None:
                await feed.start(nc.jetstream())
            for session, prompt, outcome, hint in (("tool", TOOL, TurnOutcome.TOOL_CALLS, 2.0),
                                                   ("idle", IDLE, TurnOutcome.ANSWER, 3600.0)):
                if feed is not None:
                    feed.turn_started(session, prompt, b"")
                await loop.call(lambda e, p=prompt: e.generate([p], PARAMS))
                await nc.jetstream().publish(subjects.SESSION_EVENTS, ended(session, outcome, hint).to_bytes())
            if feed is not None:
                await eventually(lambda: feed.events == 2, 10, "both turn ends reached the worker's book")
            await loop.call(lambda e: e.generate([CHURN], PARAMS))  # needs 7 of 14 blocks: someone goes
            again = await loop.call(lambda e: e.generate([TOOL], PARAMS)[0])
            if feed is not None:
                await feed.stop()
        return again.cached_tokens, again.token_ids
    finally:
        loop.stop()


@pytest.fixture
def cold(tiny_loaded) -> list[int]:
    return Engine(tiny_loaded, EngineSettings(block_size=BS, num_blocks=64)).generate([TOOL], PARAMS)[0].token_ids


async def test_the_tool_call_session_stays_where_lru_evicts_it(tiny_loaded, fresh_nats_server, cold) -> None:
    lru_cached, lru_tokens = await run_turns(tiny_loaded, "lru", fresh_nats_server.url)
    cached, tokens = await run_turns(tiny_loaded, "session", fresh_nats_server.url)
    assert lru_cached < len(TOOL) - BS  # LRU lost (part of) the session coming back in seconds
    assert cached == len(TOOL) - BS  # all but the last block: an L1 hit
    assert tokens == lru_tokens == cold



async def test_a_started_event_tells_the_book_whether_the_client_named_the_session(tiny_loaded) -> None:
    """The ingress's `named` reaches the worker's book: the default policy trusts a named session's new blocks."""
    engine = Engine(tiny_loaded, EngineSettings(block_size=BS, num_blocks=14, eviction_policy="default"))
    loop = EngineLoop(engine)
    loop.start()
    try:
        feed = SessionFeed(loop, engine.cache.policy)
        for session, named in (("agent", True), ("guessed", False)):
            ev = SessionEvent(tenant="t", session_id=session, request_id=f"r-{session}",
                              outcome=TurnOutcome.STARTED, at=time.time(), named=named)
            await feed._on_event(SimpleNamespace(data=ev.to_bytes()))
        book = engine.cache.policy.book
        assert feed.started == 2
        assert await loop.call(lambda e: (book.named_by_client("agent"), book.named_by_client("guessed"))) == (
            True, False)
    finally:
        loop.stop()


async def test_a_sub_agents_events_link_it_to_its_parent_in_the_workers_book(tiny_loaded) -> None:
    """A child that names its parent: the prefix they share ranks by the parent's return (a tool call that
    waits on the child), not by the child's answer, which a person reads much later."""
    engine = Engine(tiny_loaded, EngineSettings(block_size=BS, num_blocks=64, eviction_policy="default"))
    loop = EngineLoop(engine)
    loop.start()
    try:
        feed = SessionFeed(loop, engine.cache.policy)
        feed.turn_started("parent", TOOL, b"")
        await feed._on_event(SimpleNamespace(data=ended("parent", TurnOutcome.TOOL_CALLS, 2.0).to_bytes()))
        for outcome in (TurnOutcome.STARTED, TurnOutcome.ANSWER):
            if outcome is TurnOutcome.ANSWER:
                feed.turn_started("child", TOOL + IDLE[: 2 * BS], b"")
            ev = SessionEvent(tenant="t", session_id="child", request_id="r-child", outcome=outcome,
                              at=time.time(), named=True, parent_session_id="parent",
                              expected_return_ms=3_600_000 if outcome is TurnOutcome.ANSWER else None)
            await feed._on_event(SimpleNamespace(data=ev.to_bytes()))
        book = engine.cache.policy.book

        def ranks(e) -> tuple[float, float, float]:
            shared, own = e.block_hashes(TOOL, b"")[0], e.block_hashes(TOOL + IDLE[: 2 * BS], b"")[-1]
            return book.next_use(shared, 0.0), book.next_use(own, 0.0), book.outlook("parent").next_use()
        shared, own, parent_back = await loop.call(ranks)
        assert shared == parent_back < own
    finally:
        loop.stop()
