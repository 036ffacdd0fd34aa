"""A request's output on `subjects.tokens(request_id)`, published in order.

Events go out on core NATS only (no stream stores them: that cost a disk write
and fsync per event; `kvmesh bench token-events`). Whatever piles up while
one publish is in flight goes out as the next event (several
tokens, `seq` of the first), so the stream never falls behind the engine
and events stay in seq order. `finish` publishes what is left as the final
event. Events carry (request, attempt, seq, count, final) as their message
id; the ingress drops repeats by attempt and seq, so a redelivered job that
runs again (same ids, same tokens) adds nothing. Once `fenced()` says the attempt was
replaced or aborted, the stream publishes nothing more (not even a final
event): a worker resumed after a pause may hold tokens its engine made
before it read the abort.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.bus.publish import Publisher
from kvmesh.protocol import subjects
from kvmesh.protocol.serving import TokenEvent


def event_msg_id(ev: TokenEvent) -> str:
    return f"{ev.request_id}:{ev.attempt}:{ev.seq}:{len(ev.token_ids)}:{int(ev.finished)}"


def _never() -> bool:
    return False


async def publish_event(publisher: Publisher, ev: TokenEvent) -> None:
    # Core NATS, no stream: the ingress orders by seq, drops duplicates and times a silent worker out
    # (a lost event is a gap it never delivers past), so a lost event costs a migration, never a wrong answer.
    await publisher.send(subjects.tokens(ev.request_id), ev, msg_id=event_msg_id(ev))


@dataclass
class TokenStream:
    publisher: Publisher
    request_id: str
    attempt: int
    worker_id: str
    next_seq: int  # seq of the next token to publish
    prompt_tokens: int
    cached_tokens: int
    fenced: Callable[[], bool] = _never  # True: this attempt must say nothing more (checked before each publish)
    tier_tokens: dict[str, int] | None = None  # where cached_tokens came from: on the first event only
    _ids: list[int] = field(default_factory=list)
    _text: str = ""
    _final: dict | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task | None = None

    def __post_init__(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def add(self, token_ids: list[int], text: str) -> None:
        """Queue tokens (called on the event loop, in engine order)."""
        self._ids += token_ids
        self._text += text
        self._wake.set()

    async def finish(self, reason: str | None, error: str | None = None, retriable: bool = True,
                     cache_created_tokens: int = 0) -> None:
        """Publish what is left as the final event; raises if a publish failed for good."""
        self._final = {"finish_reason": reason, "error": error, "retriable": retriable,
                       "cache_created_tokens": cache_created_tokens}
        self._wake.set()
        assert self._task is not None
        await self._task

    def cancel(self) -> None:
        """Stop without a final event (the request was handed to a newer attempt)."""
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            final = self._final
            if self.fenced():
                return
            if self._ids or final is not None:
                ids, text = self._ids, self._text
                self._ids, self._text = [], ""
                ev = TokenEvent(request_id=self.request_id, attempt=self.attempt, seq=self.next_seq, token_ids=ids,
                                text=text, finished=final is not None, prompt_tokens=self.prompt_tokens,
                                cached_tokens=self.cached_tokens, tier_tokens=self.tier_tokens,
                                worker_id=self.worker_id, **(final or {}))
                self.tier_tokens = None
                self.next_seq += len(ids)
                await publish_event(self.publisher, ev)
            if final is not None:
                return
