"""Waits for events and states, shared by the test packages: never a sleep standing in for one.

- `until` / `until_sync`: poll a real condition against a generous deadline and return what it
  found; past the deadline the test fails naming what it waited for.
- `taken`: everything the server has sent some subscriptions so far has been handled, so a count
  read next is final up to that point (a negative check reads it after a later event).
- `WorkerWatch`: a worker's DOWN in the `workers` bucket (its heartbeat expired or was deleted),
  the event that shows a killed process is gone and everything it sent has reached the server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from kvmesh.aio import next_within
from kvmesh.service.watch import Change, WorkerChange, watch_workers
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

T = TypeVar("T")

POLL_S = 0.05


async def until(check: Callable[[], T | Awaitable[T]], timeout_s: float, what: str, poll_s: float = POLL_S) -> T:
    """The first truthy result of `check` (sync or async), polled every `poll_s`; fails naming `what`."""
    end = time.monotonic() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result  # type: ignore[return-value]
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s}s waiting for: {what}")
        await asyncio.sleep(poll_s)


def until_sync(check: Callable[[], T], timeout_s: float, what: str, poll_s: float = POLL_S) -> T:
    """`until` for synchronous tests (a blocking client, subprocesses)."""
    end = time.monotonic() + timeout_s
    while True:
        if result := check():
            return result
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s}s waiting for: {what}")
        time.sleep(poll_s)


async def taken(nc: NATS, *collectors: object, timeout_s: float = 10.0) -> None:
    """Every message the server sent the collectors' subscriptions (their `_sub`) before now has been handled.

    A round trip first: the server sends to a connection in order, so whatever it sent before the
    PONG has arrived and sits in a subscription's queue. Then each queue empties; a callback without
    an await in it (TokenCollector's) has run for every message taken off its queue.
    """
    await nc.flush(timeout=timeout_s)
    subs = [c._sub for c in collectors]  # the collector's own subscription
    await until(lambda: all(s.pending_msgs == 0 for s in subs), timeout_s, "the collectors handled what arrived")


class WorkerWatch:
    """A watch of the `workers` bucket that has seen one worker up; `down()` waits for its DOWN.

    Start it before the worker is killed: a watch only reports DOWN for workers it saw up.
    """

    def __init__(self, changes: AsyncIterator[WorkerChange], worker_id: str) -> None:
        self._changes = changes
        self.worker_id = worker_id

    @classmethod
    async def up(cls, js: JetStreamContext, worker_id: str, timeout_s: float = 30.0) -> WorkerWatch:
        watch = cls(watch_workers(js), worker_id)
        try:
            change = await watch._next(timeout_s, f"{worker_id} up in the workers bucket")
        except BaseException:
            await watch.close()
            raise
        assert change.change is Change.UP, change
        return watch

    async def down(self, timeout_s: float = 30.0) -> WorkerChange:
        """The worker's DOWN (then the watch is closed)."""
        try:
            change = await self._next(timeout_s, f"{self.worker_id} down in the workers bucket")
            assert change.change is Change.DOWN, change
            return change
        finally:
            await self.close()

    async def close(self) -> None:
        await self._changes.aclose()  # type: ignore[attr-defined]

    async def _next(self, timeout_s: float, what: str) -> WorkerChange:
        end = time.monotonic() + timeout_s
        while True:
            try:
                change = await next_within(self._changes, max(0.0, end - time.monotonic()))
            except TimeoutError:
                raise AssertionError(f"timed out after {timeout_s}s waiting for: {what}") from None
            except StopAsyncIteration:
                raise AssertionError(f"the workers watch ended while waiting for: {what}") from None
            if change.worker_id == self.worker_id:
                return change
