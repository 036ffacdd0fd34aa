"""The turn-start signal: an admitted request's session is in use before any worker takes its job.

A real stack (nats-server, prefill, decode, ingress) serves a session's
first turn; the eviction service's planner and a worker's session feed,
both fed by the real SESSIONS stream, then hold the session as away. The
prefill worker is stopped (SIGSTOP; its heartbeat TTL is long enough that
routing still picks it), and the session's next turn is sent: its job is
published but nobody can take it. Both books must now hold the session as
in use, from the ingress's ``started`` event alone. Once the worker is
continued, the turn completes and its end event puts the session away again.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from bus.helpers import FAST_BUS, connected, eventually
from ingress.serving_stack import ServingStack, job_count, one_of_each
from kvmesh.bus.publish import Publisher
from kvmesh.config import EngineSettings, EvictionSettings, SessionRetentionSettings
from kvmesh.engine.engine import Engine
from kvmesh.eviction.service import EvictionService
from kvmesh.serving.engine_loop import EngineLoop
from kvmesh.serving.session_feed import SessionFeed
from kvmesh.sessions.identity import scoped_session_id

KEYS = {"sk-turn": "turn-tenant"}
TENANT = "turn-tenant"
SETTINGS = EvictionSettings(tick_s=0.5, gc_interval_s=3600, sessions=SessionRetentionSettings(enabled=True))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServingStack]:
    # A stopped worker stays routable for the test's span: its heartbeat entry outlives the pause.
    with one_of_each(tmp_path_factory.mktemp("turn-start"), None, tiny_model_dir, KEYS,
                     KVMESH_SERVICE__HEARTBEAT_TTL_S="120") as s:
        yield s


async def _more_jobs(stack: ServingStack, before: int) -> bool:
    return await job_count(stack.nats.url) > before


async def chat(client: openai.AsyncOpenAI, model: str, messages: list[dict]) -> str:
    reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                                 extra_headers={"x-session-id": "agent-1"})
    return reply.choices[0].message.content or ""


async def test_an_admitted_turn_is_in_use_before_its_job_is_taken(stack: ServingStack, tiny_loaded) -> None:
    session = scoped_session_id(TENANT, "agent-1")
    engine = Engine(tiny_loaded, EngineSettings(block_size=16, num_blocks=64, eviction_policy="session"))
    loop = EngineLoop(engine)
    loop.start()
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-turn", max_retries=0, timeout=120)
    model = (await client.models.list()).data[0].id
    try:
        async with connected(stack.nats.url, "turn-start") as nc:
            js = nc.jetstream()
            svc = EvictionService(nc, js, Publisher(js, FAST_BUS), SETTINGS, l1_capacity=512)
            feed = SessionFeed(loop, engine.cache.policy)
            await svc.start()
            await feed.start(js)
            feed_book, planner = engine.cache.policy.book, svc.retention
            try:
                first = [{"role": "user", "content": "List the files in the repository, then stop."}]
                answer = await chat(client, model, first)
                await eventually(lambda: feed.started == 1 and feed.events == 2, 30, "turn 1 started and ended")
                await eventually(lambda: planner.book.outlook(f"{TENANT}\x1f{session}") is not None, 30,
                                 "the planner saw turn 1 end")
                assert not feed_book.in_turn(session) and not planner.in_turn(TENANT, session)

                jobs = await job_count(stack.nats.url)
                stack.signal("prefill-0", signal.SIGSTOP)
                try:
                    second = [*first, {"role": "assistant", "content": answer},
                              {"role": "user", "content": "Now open the first one."}]
                    pending = asyncio.create_task(chat(client, model, second))
                    await eventually(lambda: feed.started == 2, 30, "turn 2's start reached the worker's feed")
                    await eventually(lambda: planner.in_turn(TENANT, session), 30, "the planner holds turn 2")
                    assert feed_book.in_turn(session)
                    # The job is out, and nobody has answered it: the stopped worker cannot take it.
                    await eventually(lambda: _more_jobs(stack, jobs), 30, "turn 2's job published")
                    assert not pending.done()
                finally:
                    stack.signal("prefill-0", signal.SIGCONT)
                await asyncio.wait_for(pending, 120)
                await eventually(lambda: feed.events == 4, 30, "turn 2 ended at the worker's feed")
                await eventually(lambda: not planner.in_turn(TENANT, session), 30, "the planner saw turn 2 end")
                assert not feed_book.in_turn(session)
            finally:
                await feed.stop()
                await svc.stop()
    finally:
        await client.close()
        loop.stop()
