"""A worker's own eviction, session-aware: its engine's `SessionBook` fed with the sessions' turns.

With `engine.eviction_policy = "session"`, what the engine evicts when a
request needs room is ranked by the block's session's predicted next use
(shared/cache_policy/session.py), as the eviction service ranks its advice.
In an agent's tool loop that matters most: the session that just left for
a tool comes back in seconds, but is the least recently used one in the
pool, which is what LRU evicts first. The worker feeds the book:

- the session's ``started`` event (the ingress admitted its turn) starts
  the turn: the session is in use while its job waits in a queue, however
  long past its predicted return that is;
- a job's arrival starts the turn if the event has not (a lost or late
  event), and binds the prompt's blocks to it;
- the session's `SessionEvent` (stream SESSIONS, new events only) ends the
  turn with its outcome, tools and hint;
- an event that names the session's parent (a sub-agent) links the two in
  the book, so the prefix they share ranks by the earliest of their returns;
- every `tick_s` the book re-estimates sessions still away (`advance`).

After each, the evictable blocks whose rank moved are re-keyed in the prefix
cache. All of it runs on the engine thread (the book and the cache are the
engine's), in the engine's monotonic clock: event times (unix seconds) are
converted on arrival. Advice only: a lost event leaves blocks ranked by the
prior, never changes what a request computes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from contextlib import suppress

from kvmesh.cache_policy.session import SessionAware
from kvmesh.log import get_logger
from kvmesh.lru import BoundedLRU
from kvmesh.protocol import subjects
from kvmesh.protocol.base import ProtocolError
from kvmesh.protocol.streams import SESSIONS
from kvmesh.serving.engine_loop import EngineLoop
from kvmesh.sessions.events import SessionEvent, TurnOutcome
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

log = get_logger(__name__)

_ENDED_REMEMBERED = 4096  # requests whose end was seen: a started event arriving after its end is stale


def _monotonic(unix_s: float) -> float:
    return time.monotonic() - (time.time() - unix_s)


class SessionFeed:
    """`start(js)` subscribes; `turn_started` is called by the worker for each job; `stop()` ends it.
    `events` counts the events applied, `started` the turn starts among them."""

    def __init__(self, engine: EngineLoop, policy: SessionAware, tick_s: float = 1.0) -> None:
        self.engine, self.policy, self.tick_s = engine, policy, tick_s
        self.events = 0  # session events applied (for tests and logs)
        self.started = 0  # of which turn starts
        self._ended: BoundedLRU[str, None] = BoundedLRU(_ENDED_REMEMBERED)
        self._sub = None
        self._ticker: asyncio.Task[None] | None = None

    async def start(self, js: JetStreamContext) -> None:
        fresh = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW)  # an old turn's return is long past
        self._sub = await js.subscribe(subjects.SESSION_EVENTS, stream=SESSIONS.name, cb=self._on_event,
                                       ordered_consumer=True, config=fresh, idle_heartbeat=1.0)
        self._ticker = asyncio.create_task(self._tick())

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with suppress(asyncio.CancelledError):
                await self._ticker
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()

    def turn_started(self, session_id: str, prompt_ids: Sequence[int], tenant_salt: bytes) -> None:
        """The job arrived: its turn starts on the engine thread before anything the worker asks of the engine
        after this (the engine runs its commands in order), without the job waiting for it."""
        book = self.policy.book
        now = time.monotonic()

        def start(e) -> None:
            book.turn_started(session_id, e.block_hashes(prompt_ids, tenant_salt), now)
            e.cache.rekey(book.take_changed())
        self.engine.post(start)

    async def _on_event(self, msg: Msg) -> None:
        try:
            ev = SessionEvent.from_bytes(msg.data)
        except ProtocolError as exc:
            log.warning("unreadable session event skipped", error=str(exc))
            return
        book = self.policy.book
        if ev.outcome is TurnOutcome.STARTED:
            if ev.request_id in self._ended:
                return  # delivered after its own end: the turn is over

            def start(e) -> None:
                if ev.parent_session_id is not None:
                    book.link(ev.session_id, ev.parent_session_id)
                book.turn_announced(ev.session_id, _monotonic(ev.at), explicit=ev.named)
                e.cache.rekey(book.take_changed())
            await self.engine.call(start)
            self.started += 1
            self.events += 1
            return
        if ev.request_id:
            self._ended.put(ev.request_id, None)
        hint = None if ev.expected_return_ms is None else ev.expected_return_ms / 1000.0

        def end(e) -> None:
            if ev.parent_session_id is not None:
                book.link(ev.session_id, ev.parent_session_id)
            book.turn_ended(ev.session_id, _monotonic(ev.at), ev.outcome, ev.tools, hint)
            e.cache.rekey(book.take_changed())
        await self.engine.call(end)
        self.events += 1

    async def _tick(self) -> None:
        book = self.policy.book

        def advance(e) -> None:
            book.advance(time.monotonic())
            e.cache.rekey(book.take_changed())
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.engine.call(advance)
            except Exception as exc:  # noqa: BLE001 - the engine stopping ends the worker anyway
                log.warning("session re-estimate failed", error=repr(exc))
