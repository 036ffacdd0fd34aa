"""Timed waits that never swallow a cancel.

On Python 3.11, `asyncio.wait_for` returns the awaited result when a cancel reaches it in the
same loop turn that the result arrives: the cancel is lost, and a loop stopped by
`task.cancel()` goes on running (its owner then waits for it forever). A KV watcher fed by
heartbeats, or an event set while its waiter is cancelled, hits this often enough under load.
`asyncio.timeout` does not lose cancels, so long-lived loops wait through these helpers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout_s: float | None) -> bool:
    """True once `event` is set, False after `timeout_s` (None: no limit)."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def next_within(items: AsyncIterator[T], timeout_s: float | None) -> T:
    """The next item of `items`; TimeoutError after `timeout_s`, StopAsyncIteration at its end."""
    async with asyncio.timeout(timeout_s):
        return await anext(items)


async def cancel_and_wait(tasks: Iterable[asyncio.Task], resend_s: float = 0.5) -> None:
    """Cancel `tasks` and wait until every one has ended, cancelling again each `resend_s` while any runs.

    A task whose cancel was lost inside a library's `asyncio.wait_for` (nats-py's requests and KV
    reads use it) goes on; the next cancel reaches it at its next await. Their results and errors are
    dropped: a task stopped here has nothing left to report.
    """
    pending = set(tasks)
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=resend_s)
